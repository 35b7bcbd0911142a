//! Free space where a file is about to be written. `std::fs` cannot tell and this crate has
//! no `unsafe` (no `statvfs` of its own), so it asks POSIX `df -Pk`, whose fourth column
//! of its last line is the space available to unprivileged users, in KiB.

use std::path::Path;
use std::process::Command;

/// Bytes available in the file system holding `dir`, or `None` when `df` could not say
/// (not installed, another output format): the caller then writes without the check.
pub fn available(dir: &Path) -> Option<u64> {
    let out = Command::new("df").arg("-Pk").arg(dir).output().ok().filter(|o| o.status.success())?;
    parse_df(&String::from_utf8_lossy(&out.stdout))
}

/// The available bytes in `df -Pk`'s output.
fn parse_df(text: &str) -> Option<u64> {
    let line = text.lines().rfind(|l| !l.trim().is_empty())?;
    let kib: u64 = line.split_whitespace().nth(3)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dfs_posix_output_gives_the_available_column() {
        let text =
            "Filesystem     1024-blocks     Used Available Capacity Mounted on\n/dev/vda         263174212 36535116 58979012      39% /\n";
        assert_eq!(parse_df(text), Some(58_979_012 * 1024));
        assert_eq!(parse_df("garbage"), None);
        assert_eq!(parse_df(""), None);
    }

    #[test]
    fn the_temporary_directory_has_some_space() {
        // df is part of every POSIX system this runs on; where it is missing the check is
        // skipped rather than failed.
        if let Some(n) = available(&std::env::temp_dir()) {
            assert!(n > 0);
        }
    }
}
