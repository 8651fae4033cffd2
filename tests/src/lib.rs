//! Shared harness for the integration tests, the benchmarks and the demo: privilege checks,
//! CPU pinning, packet fixtures, an independent reference parser, network namespaces with veth
//! pairs, and the flood generator.

pub mod cpu;
pub mod flood;
pub mod frames;
pub mod netns;
pub mod privileged;
pub mod reference;
