//! Shared harness for the integration tests, the benchmarks and the demo: privilege checks,
//! CPU pinning, packet fixtures, an independent reference parser, network namespaces with veth
//! pairs, the flood generator, a capture of what got through, GCRA bounds, and the real daemon
//! run as a process with its CLI, its kernel maps and what it reports (stats, /metrics).

pub mod bounds;
pub mod capture;
pub mod cpu;
pub mod daemon;
pub mod flood;
pub mod frames;
pub mod kernel_programs;
pub mod livegen;
pub mod netns;
pub mod observe;
pub mod peers;
pub mod plot;
pub mod policies;
pub mod privileged;
pub mod reference;
pub mod rig;
pub mod scrape;
pub mod snmp;
