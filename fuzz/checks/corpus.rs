//! Replays a committed fuzz corpus (`fuzz/corpus/<target>`) in a stable test of the crate
//! that owns the code under test.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

/// Runs `check` on every file of the target's corpus; fails naming each file that panics.
pub fn replay(target: &str, check: impl Fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let (mut n, mut failed) = (0, Vec::new());
    for entry in entries {
        let path = entry.expect("corpus entry").path();
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if catch_unwind(AssertUnwindSafe(|| check(&data))).is_err() {
            failed.push(path.display().to_string());
        }
        n += 1;
    }
    // An empty or missing corpus would make the replay pass vacuously.
    assert!(n >= 10, "only {n} corpus files in {}", dir.display());
    assert!(failed.is_empty(), "{} of {n} inputs fail: {failed:#?}", failed.len());
}
