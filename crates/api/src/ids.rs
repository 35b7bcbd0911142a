//! Fresh identifiers for requests and completions (unique, not secret).

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// 32 hex digits of [`random_u128`].
pub(crate) fn random_hex() -> String {
    format!("{:032x}", random_u128())
}

/// A process-wide counter and the clock, mixed through two randomly keyed SipHash
/// instances, so values differ across requests, restarts and processes.
pub(crate) fn random_u128() -> u128 {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let word = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        h.write_u64(salt);
        h.finish()
    };
    (u128::from(word(1)) << 64) | u128::from(word(2))
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
