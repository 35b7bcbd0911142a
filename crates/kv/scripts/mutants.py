#!/usr/bin/env python3
"""Hand-written mutation check for bulkhead-kv: removes each isolation check in turn, runs
`cargo test -p bulkhead-kv`, and reports which tests fail. Every mutant must be caught.

Run from anywhere: python3 crates/kv/scripts/mutants.py [NAME...]
Files are always restored, even on Ctrl-C.
"""
import os, re, subprocess, sys

KV = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pool is split: bookkeeping (who holds a page), storage (the bytes), and the pool itself.
BOOK, STORAGE, POOL, HANDLES = "src/pool/book.rs", "src/pool/storage.rs", "src/pool/mod.rs", "src/pool/handles.rs"
SEQ = "src/sequence.rs"

# (name, file, original text (must occur exactly once), replacement)
MUTANTS = [
    ("generation compare", BOOK, "let generation_ok = meta.generation == tag.generation;", "let generation_ok = true;"),
    ("owner compare", BOOK, "let owner_ok = meta.state.owner() == Some(tag.owner);", "let owner_ok = true;"),
    ("state == Leased", BOOK, "Want::Leased => matches!(meta.state, PageState::Leased(_)),", "Want::Leased => true,"),
    ("state == Quarantined", BOOK, "Want::Quarantined => matches!(meta.state, PageState::Quarantined(_)),", "Want::Quarantined => true,"),
    ("foreign pool", BOOK, "fn verify(&self, tag: &PageTag, want: Want) -> Result<(), KvError> {\n        if tag.pool != self.id {",
     "fn verify(&self, tag: &PageTag, want: Want) -> Result<(), KvError> {\n        if false {"),
    ("read limited to watermark (read)", STORAGE, "let len = self.watermarks[self.wm_index(page, layer)];", "let len = self.layout.page_size;"),
    ("read limited to watermark (k_head/v_head)", STORAGE, "&block[start..start + self.len * self.head_dim]", "&block[start..start + self.page_size * self.head_dim]"),
    ("sequential write", STORAGE, "if slot != watermark {", "if false {"),
    ("page_size bound", STORAGE, "if slot >= page_size {", "if false {"),
    ("lease_many all-or-nothing", BOOK, "if n > self.free.len() {", "if false {"),
    ("layer range", POOL, "if layer >= self.layout.layers {", "if false {"),
    ("row length", STORAGE, "if k.len() != row || v.len() != row {", "if false {"),
    ("poison on free", STORAGE, "self.reset_watermarks(page);\n        if self.checks.canaries {", "self.reset_watermarks(page);\n        if false {"),
    ("watermarks reset on free", STORAGE, "fn scrub(&mut self, page: PageId) {\n        self.reset_watermarks(page);", "fn scrub(&mut self, page: PageId) {"),
    ("watermarks reset on quarantine", BOOK, "        self.reset_watermarks(tag.page);\n", ""),
    ("orphan check (a dropped lease)", BOOK, "self.holds.is_held(PageId(i as u32), m.generation),", "true,"),
    ("a stale lease's drop keeps a newer lease's mark", HANDLES,
     "let _ = entry.compare_exchange(generation.0, 0, Ordering::Relaxed, Ordering::Relaxed);", "entry.store(0, Ordering::Relaxed);"),
    ("commit checks watermarks", SEQ, "if watermark < need {", "if false {"),
    ("commit within reservation", SEQ, "if end > reserved {", "if false {"),
    ("sequence bound to one pool", SEQ, "&& b.pool != pool.id()", "&& false"),
]


def run_tests():
    p = subprocess.run(["cargo", "test", "-p", "bulkhead-kv", "--no-fail-fast"], cwd=KV,
                       capture_output=True, text=True)
    out = p.stdout + p.stderr
    if "error[E" in out or "could not compile" in out:
        return None, out
    failed = re.findall(r"^test (\S+) \.\.\. FAILED", out, re.M)
    return failed, out


def main():
    only = set(sys.argv[1:])
    base, out = run_tests()
    if base is None or base:
        sys.exit(f"baseline is not green:\n{out[-3000:]}")
    rows, uncaught = [], []
    for name, rel, old, new in MUTANTS:
        if only and name not in only:
            continue
        path = os.path.join(KV, rel)
        text = open(path).read()
        assert text.count(old) == 1, f"{name}: pattern occurs {text.count(old)} times in {rel}"
        try:
            open(path, "w").write(text.replace(old, new))
            failed, out = run_tests()
        finally:
            open(path, "w").write(text)
        if failed is None:
            rows.append((name, "BUILD FAILED"))
            uncaught.append(name)
        elif not failed:
            rows.append((name, "NOT CAUGHT"))
            uncaught.append(name)
        else:
            rows.append((name, ", ".join(failed)))
        print(f"{rows[-1][0]:45} | {rows[-1][1]}", flush=True)
    if uncaught:
        sys.exit(f"uncaught mutants: {uncaught}")


if __name__ == "__main__":
    main()
