//! What a policy says (rate, burst, key, unit, mode) and its kernel form.

use limiter_common::{
    Gcra,
    gcra::GcraError,
    key::prefix_mask_words,
    maps::{MAX_FRAME_WEIGHT, Policy},
};

use crate::rate::Rate;

/// How sources are grouped into one allowance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySpec {
    pub v4_prefix: u8,
    pub v6_prefix: u8,
    pub dport: bool,
}

impl Default for KeySpec {
    fn default() -> Self {
        Self { v4_prefix: 32, v6_prefix: 64, dport: false }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Unit {
    #[default]
    Packets,
    Bytes,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    pub rate: Rate,
    pub burst: u64,
    pub key: KeySpec,
    pub unit: Unit,
    pub dry_run: bool,
}

impl PolicySpec {
    /// The kernel's form of this policy under `id`.
    pub fn compile(&self, id: u16) -> Result<Policy, GcraError> {
        let max_weight = match self.unit {
            Unit::Packets => 1,
            Unit::Bytes => MAX_FRAME_WEIGHT,
        };
        let gcra = Gcra::new(self.rate.count, self.rate.period_ns, self.burst, max_weight)?;
        let mut flags = Policy::ACTIVE;
        if self.unit == Unit::Bytes {
            flags |= Policy::BYTES;
        }
        if self.dry_run {
            flags |= Policy::DRY_RUN;
        }
        if self.key.dport {
            flags |= Policy::KEY_DPORT;
        }
        Ok(Policy {
            gcra,
            v6_mask: prefix_mask_words(self.key.v6_prefix),
            v4_mask: prefix_mask_words(self.key.v4_prefix)[0],
            flags,
            id,
            _pad: 0,
        })
    }
}
