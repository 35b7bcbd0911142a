//! Memory of its own, advised for transparent huge pages: for buffers read a block at a
//! time far apart (the pool's pages here, the model's laid-out weights), where through 4 KB
//! pages nearly every block costs TLB misses.

/// One huge page: below it a map of its own gains nothing and costs system calls (the model
/// checker makes pools of a few bytes by the million).
pub const HUGE_PAGE: usize = 2 << 20;

/// `bytes` of zeroed anonymous memory advised `MADV_HUGEPAGE`, from [`HUGE_PAGE`] up;
/// `None` below it or where no map can be made, and the caller keeps ordinary memory.
pub fn huge_map(bytes: usize) -> Option<memmap2::MmapMut> {
    if bytes < HUGE_PAGE {
        return None;
    }
    let map = memmap2::MmapMut::map_anon(bytes).ok()?;
    // A hint: without transparent huge pages the kernel refuses it and 4 KB pages serve.
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    Some(map)
}
