//! Salts come from the OS CSPRNG and go nowhere but the kernel map.

use limiter_common::SipKey;

use crate::Error;

pub fn draw() -> Result<SipKey, Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| Error::Salt(e.to_string()))?;
    let (k0, k1) = bytes.split_at(8);
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    Ok(SipKey { k0: word(k0), k1: word(k1) })
}
