//! The tests' own policies and addresses, written as literals and valid by construction.

use std::net::IpAddr;

use limiter_common::Gcra;

use crate::rig::SEC;

/// GCRA at `per_sec` a second with a burst of `burst`, one unit per packet.
pub fn gcra(per_sec: u64, burst: u64) -> Gcra {
    Gcra::new(per_sec, SEC, burst, 1).expect("the test's policies are valid")
}

/// An address written in a test.
pub fn src(s: &str) -> IpAddr {
    s.parse().expect("the test's addresses parse")
}
