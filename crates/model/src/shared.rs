//! One copy of a model's laid-out weights per host: the packed matrices written once to a
//! file keyed by the model's digest and layout, and mapped read-only by every worker process
//! that loads the model, so a prefill and a decode worker on one host share the page cache
//! instead of holding a copy each, and a restart maps instead of packing again.
//!
//! The file is written whole under a temporary name and renamed into place, under an
//! exclusive lock that also makes a second process wait for the first one's file rather than
//! pack its own; it is never written in place, so a map stays valid while it lives. What a
//! map holds is checked before any kernel reads it: the header (digest, layout, every
//! matrix's name, type, shape and length against what the model file implies) and an xxh3
//! checksum of the whole data section. A file that fails any check is rebuilt; one that
//! cannot be written leaves the process with its own copy, which is only slower to share.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bulkhead_gguf::{GgmlType, GgufFile};

use crate::kernels::{Isa, packed};
use crate::weights::{Bytes, Matrix, Weights};
use crate::{LlamaConfig, ModelError};

const MAGIC: &[u8; 4] = b"BHWC";
/// Bumped whenever the packed layout or this file's format changes.
const VERSION: u32 = 2;
/// Each matrix starts at a multiple of this in the data section (a cache line).
const ALIGN: usize = 64;

/// A read-only map of a shared weights file.
pub struct Map {
    map: memmap2::Mmap,
}

impl Map {
    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// What [`load`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shared {
    /// Mapped a file another load (this process's earlier run, or a worker beside it) wrote.
    Mapped(PathBuf),
    /// Packed the weights, wrote the file and mapped it.
    Written(PathBuf),
    /// Packed the weights and kept them: the file could not be written or mapped (why).
    Own(String),
}

/// The weights of `f` laid out for `isa`, shared through `dir` ([`Shared`] says how).
/// `digest` is the model file's ([`GgufFile::digest`]).
pub fn load(f: &GgufFile, c: &LlamaConfig, isa: Isa, digest: u64, dir: &Path) -> Result<(Weights, Shared), ModelError> {
    let name = format!("{digest:016x}-{}-{}-v{VERSION}.weights", isa.name(), isa.sums().name());
    let path = dir.join(&name);
    let lock = match std::fs::create_dir_all(dir).and_then(|()| File::create(dir.join(format!("{name}.lock")))) {
        Ok(l) => l,
        Err(e) => return Ok((Weights::load(f, c, isa)?, Shared::Own(format!("{}: {e}", dir.display())))),
    };
    // Held until this function returns: a second loader waits here for the first's file.
    if let Err(e) = lock.lock() {
        return Ok((Weights::load(f, c, isa)?, Shared::Own(format!("locking {}: {e}", path.display()))));
    }
    if let Some(map) = open(&path, digest, isa) {
        let mut from_map = |name: &str, rows, cols, isa| map.matrix(name, f.tensor_info(name)?.ty, rows, cols, isa);
        match Weights::load_with(f, c, isa, &mut from_map) {
            Ok(w) => return Ok((w, Shared::Mapped(path))),
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "shared weights file does not fit the model; writing it again"),
        }
    }
    let mut w = Weights::load(f, c, isa)?;
    let shared =
        match write(&path, &w, digest, isa).and_then(|()| open(&path, digest, isa).ok_or_else(|| "written but unreadable".to_string())) {
            Ok(map) => {
                // Swap each packed copy for its range of the map, which every process shares.
                for (name, m) in w.matrices_mut() {
                    if let Some(b) = map.bytes_of(&name) {
                        m.share(b);
                    }
                }
                Shared::Written(path)
            }
            Err(why) => Shared::Own(why),
        };
    Ok((w, shared))
}

/// One matrix's entry in the file.
struct Entry {
    ty: u32,
    rows: u64,
    cols: u64,
    packed: bool,
    start: usize,
    len: usize,
}

/// An opened, checked file.
struct Opened {
    map: Arc<Map>,
    entries: HashMap<String, Entry>,
}

impl Opened {
    fn bytes_of(&self, name: &str) -> Option<Bytes> {
        let e = self.entries.get(name)?;
        Some(Bytes::Mapped { map: Arc::clone(&self.map), start: e.start, len: e.len })
    }

    /// Matrix `name` as the file holds it, if it is the one the model file implies: its
    /// type, shape, layout for `isa` and length.
    fn matrix(&self, name: &str, ty: GgmlType, rows: usize, cols: usize, isa: Isa) -> Result<Matrix, ModelError> {
        let bad = |why: &str| ModelError::BadShape { tensor: name.to_string(), why: format!("shared weights file: {why}") };
        let e = self.entries.get(name).ok_or_else(|| bad("missing"))?;
        if e.ty != ty.code() || e.rows != rows as u64 || e.cols != cols as u64 {
            return Err(bad("another type or shape"));
        }
        let packs = isa.packs_weights() && packed::supports(ty);
        if e.packed != packs {
            return Err(bad("another layout"));
        }
        let bytes = Bytes::Mapped { map: Arc::clone(&self.map), start: e.start, len: e.len };
        Matrix::from_layout(name, ty, rows, cols, bytes, packs)
    }
}

/// Map `path` and check its header against `digest` and `isa`, and its data against its
/// checksum; `None` when it is missing or fails a check.
fn open(path: &Path, digest: u64, isa: Isa) -> Option<Opened> {
    let file = File::open(path).ok()?;
    // SAFETY: the map is read-only and this file is never written in place: writers create a
    // new file and rename it over this name, which leaves this inode, and so this map,
    // unchanged. Another program truncating the file would fault the reads; the directory
    // is the operator's (`--weights-cache`), as the model files are.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let (entries, data_at, hash) = parse_header(&map, digest, isa)?;
    if entries.values().any(|e| e.start.checked_add(e.len).is_none_or(|end| end > map.len())) {
        return None;
    }
    if xxhash_rust::xxh3::xxh3_64(&map[data_at..]) != hash {
        tracing::warn!(path = %path.display(), "shared weights file fails its checksum; writing it again");
        return None;
    }
    Some(Opened { map: Arc::new(Map { map }), entries })
}

/// A little-endian reader over the header that fails instead of panicking.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

/// The entries, where the data section starts, and its checksum.
fn parse_header(b: &[u8], digest: u64, isa: Isa) -> Option<(HashMap<String, Entry>, usize, u64)> {
    let mut r = Reader { b, at: 0 };
    if r.take(4)? != MAGIC || r.u32()? != VERSION || r.u64()? != digest || r.string()? != layout(isa) {
        return None;
    }
    let (count, data_at, hash) = (r.u32()?, usize::try_from(r.u64()?).ok()?, r.u64()?);
    let mut entries = HashMap::new();
    for _ in 0..count {
        let name = r.string()?;
        let (ty, rows, cols, packed) = (r.u32()?, r.u64()?, r.u64()?, r.u32()? != 0);
        let (start, len) = (usize::try_from(r.u64()?).ok()?, usize::try_from(r.u64()?).ok()?);
        entries.insert(name, Entry { ty, rows, cols, packed, start: data_at.checked_add(start)?, len });
    }
    (data_at <= b.len()).then_some((entries, data_at, hash))
}

fn layout(isa: Isa) -> String {
    format!("{} {}", isa.name(), isa.sums().name())
}

/// Write `w` to `path`, whole, under a temporary name first.
fn write(path: &Path, w: &Weights, digest: u64, isa: Isa) -> Result<(), String> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = write_to(&tmp, w, digest, isa).and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("writing {}: {e}", path.display())
    })
}

fn write_to(tmp: &Path, w: &Weights, digest: u64, isa: Isa) -> std::io::Result<()> {
    let mats: Vec<(String, &Matrix)> = w.matrices();
    // The data section: each matrix at the next multiple of ALIGN.
    let mut at = 0usize;
    let mut places = Vec::with_capacity(mats.len());
    for (_, m) in &mats {
        at = at.next_multiple_of(ALIGN);
        places.push(at);
        at += m.held().len();
    }
    let mut head = Vec::new();
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&digest.to_le_bytes());
    let put_str = |h: &mut Vec<u8>, s: &str| {
        h.extend_from_slice(&(s.len() as u32).to_le_bytes());
        h.extend_from_slice(s.as_bytes());
    };
    put_str(&mut head, &layout(isa));
    let mut entries = Vec::new();
    for ((name, m), start) in mats.iter().zip(&places) {
        put_str(&mut entries, name);
        entries.extend_from_slice(&m.ty.code().to_le_bytes());
        entries.extend_from_slice(&(m.rows as u64).to_le_bytes());
        entries.extend_from_slice(&(m.cols as u64).to_le_bytes());
        entries.extend_from_slice(&u32::from(m.is_packed()).to_le_bytes());
        entries.extend_from_slice(&(*start as u64).to_le_bytes());
        entries.extend_from_slice(&(m.held().len() as u64).to_le_bytes());
    }
    // count, data offset, checksum, then the entries; the data section starts on a page.
    let data_at = (head.len() + 4 + 8 + 8 + entries.len()).next_multiple_of(4096);
    let mut hash = xxhash_rust::xxh3::Xxh3::new();
    let pad = [0u8; ALIGN];
    let mut pos = 0;
    for ((_, m), start) in mats.iter().zip(&places) {
        hash.update(&pad[..start - pos]);
        hash.update(m.held());
        pos = start + m.held().len();
    }
    head.extend_from_slice(&(mats.len() as u32).to_le_bytes());
    head.extend_from_slice(&(data_at as u64).to_le_bytes());
    head.extend_from_slice(&hash.digest().to_le_bytes());
    head.extend_from_slice(&entries);
    head.resize(data_at, 0);
    let mut out = BufWriter::with_capacity(8 << 20, File::create(tmp)?);
    out.write_all(&head)?;
    let mut pos = 0;
    for ((_, m), start) in mats.iter().zip(&places) {
        out.write_all(&pad[..start - pos])?;
        out.write_all(m.held())?;
        pos = start + m.held().len();
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Llama, SeqInput};
    use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};

    /// A digest of the logits' bits after each of a few tokens (short in a failed assert).
    fn logits(m: &Llama) -> u64 {
        let tokens = [1u32, 504, 3, 77, 912];
        let layout = m.kv_layout(16);
        let mut pool = KvPool::new(PoolConfig { layout, pages: 1, checks: KvChecks::default() }).unwrap();
        let mut kv = SequenceKv::new(RequestId(1));
        kv.reserve(&mut pool, tokens.len()).unwrap();
        let l = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: &tokens, logit_rows: tokens.len() }]).unwrap();
        xxhash_rust::xxh3::xxh3_64(&l.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect::<Vec<u8>>())
    }

    /// Patch the written file: `at` bytes from its data section (or from its start).
    fn patch(path: &Path, from_data: bool, at: usize, f: impl FnOnce(&mut u8)) {
        let mut b = std::fs::read(path).unwrap();
        let base = if from_data { b.len() - b.len() / 2 } else { 0 };
        f(&mut b[base + at]);
        // A new file renamed in, as a writer would: the maps of earlier loads stay as they were.
        let tmp = path.with_extension("patched");
        std::fs::write(&tmp, b).unwrap();
        std::fs::rename(tmp, path).unwrap();
    }

    #[test]
    fn a_second_load_maps_the_first_ones_weights_and_a_damaged_file_is_written_again() {
        let p = bulkhead_fetch::ensure_default_model(false).unwrap();
        let f = GgufFile::open(&p).unwrap();
        let digest = f.digest().unwrap();
        let dir = std::env::temp_dir().join(format!("bulkhead-shared-weights-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let want = logits(&Llama::from_gguf(&f, 1).unwrap());
        let (a, how) = Llama::from_gguf_shared(&f, 1, digest, &dir).unwrap();
        let Shared::Written(path) = how else { panic!("first load: {how:?}") };
        assert_eq!(logits(&a), want, "the writer's weights, swapped for the map");
        let (b, how) = Llama::from_gguf_shared(&f, 1, digest, &dir).unwrap();
        assert_eq!(how, Shared::Mapped(path.clone()));
        assert_eq!(logits(&b), want, "the mapped weights");
        // One flipped bit of the data: the checksum refuses the file, and it is written again.
        patch(&path, true, 12_345, |b| *b ^= 1);
        let (c, how) = Llama::from_gguf_shared(&f, 1, digest, &dir).unwrap();
        assert_eq!((how, logits(&c)), (Shared::Written(path.clone()), want));
        // A header whose first matrix claims another row count: refused, written again.
        let first = 4 + 4 + 8 + 4 + layout(Isa::detect()).len() + 4 + 8 + 8 + 4 + "blk.0.attn_q.weight".len() + 4;
        patch(&path, false, first, |b| *b ^= 1);
        let (d, how) = Llama::from_gguf_shared(&f, 1, digest, &dir).unwrap();
        assert_eq!((how, logits(&d)), (Shared::Written(path.clone()), want));
        // A file cut short (in place, as no writer does: `d`'s map of it would fault).
        drop(d);
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 100).unwrap();
        let (e, how) = Llama::from_gguf_shared(&f, 1, digest, &dir).unwrap();
        assert_eq!((how, logits(&e)), (Shared::Written(path), want));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
