//! Shared harness for the integration tests, the benchmarks and the demo: privilege checks
//! ([`require_root!`]), CPU pinning, packet fixtures ([`frames`]), an independent reference
//! parser ([`reference`](mod@reference)) and the kernel's programs run in-process on frames
//! ([`kernel_programs`]), network namespaces with veth pairs ([`netns`]), the flood generators
//! ([`flood`], [`generator`]), a capture of what got through ([`capture`]) and a UDP socket
//! counting what reached it ([`receiver`]), GCRA bounds
//! ([`bounds`]), the real daemon run as a process with its CLI and its kernel maps ([`daemon`]),
//! a daemon on a veth pair ready to be flooded ([`rig`]), policies as the tests set them
//! ([`policies`]), what the daemon reports ([`observe`]: stats, /metrics via [`scrape`]), and
//! TCP bulk transfers ([`transfer`]); for sharing the interface, Debian's xdp-filter holding the
//! XDP hook ([`xdp_filter`]) and another tcx program loaded by the test ([`neighbour`]); the feeders of bans, Debian's
//! fail2ban ([`fail2ban`]) and CrowdSec's local API ([`crowdsec`]), run as processes the test
//! starts and stops ([`service`]); what the ban tests share ([`ban_rig`]) and bans watched on
//! traffic ([`bans`]); what the microbenchmarks share ([`microbench`]); waits stretched on a
//! slower machine ([`slowdown`]); the kernel matrix's VMs ([`vm`]) and what the verifier made of
//! the programs ([`verifier`]).

pub mod ban_rig;
pub mod bans;
pub mod bounds;
pub mod capture;
pub mod cpu;
pub mod crowdsec;
pub mod daemon;
pub mod fail2ban;
pub mod flood;
pub mod frames;
pub mod generator;
pub mod kernel_programs;
pub mod microbench;
pub mod neighbour;
pub mod netns;
pub mod observe;
pub mod peers;
pub mod plot;
pub mod policies;
pub mod privileged;
pub mod receiver;
pub mod reference;
pub mod rig;
pub mod scrape;
pub mod service;
pub mod slowdown;
pub mod snmp;
pub mod transfer;
pub mod verifier;
pub mod vm;
pub mod xdp_filter;
