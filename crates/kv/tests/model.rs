//! State-machine property test: random operations on a tiny pool, checked after every step
//! against a simple model of what the pool must do.

use bulkhead_kv::{Generation, KvChecks, KvError, KvLayout, KvPool, Lease, PageId, PoolConfig, Quarantined, RequestId};
use half::f16;
use proptest::prelude::*;
use proptest::sample::Index;

const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 2, head_dim: 2, page_size: 4 };
const PAGES: usize = 4;
const OWNERS: u64 = 3;
const ROW: usize = 4; // kv_heads * head_dim

#[derive(Clone, Debug)]
enum Op {
    Lease {
        owner: u64,
    },
    LeaseMany {
        owner: u64,
        n: usize,
    },
    /// `slot: None` writes at the model's watermark (the common, valid case).
    Write {
        lease: Index,
        layer: usize,
        slot: Option<usize>,
        seed: i16,
        bad_len: bool,
    },
    Read {
        lease: Index,
        layer: usize,
    },
    Release {
        lease: Index,
    },
    Quarantine {
        lease: Index,
    },
    ReleaseQuarantined {
        q: Index,
    },
    Revoke {
        owner: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let owner = 0..OWNERS;
    let layer = 0..=LAYOUT.layers; // includes one out of range
    prop_oneof![
        3 => owner.clone().prop_map(|owner| Op::Lease { owner }),
        1 => (owner.clone(), 0..=PAGES + 1).prop_map(|(owner, n)| Op::LeaseMany { owner, n }),
        8 => (
            any::<Index>(),
            layer.clone(),
            prop_oneof![4 => Just(None), 1 => (0..LAYOUT.page_size + 2).prop_map(Some)],
            any::<i16>(),
            proptest::bool::weighted(0.05),
        )
            .prop_map(|(lease, layer, slot, seed, bad_len)| Op::Write { lease, layer, slot, seed, bad_len }),
        4 => (any::<Index>(), layer).prop_map(|(lease, layer)| Op::Read { lease, layer }),
        2 => any::<Index>().prop_map(|lease| Op::Release { lease }),
        1 => any::<Index>().prop_map(|lease| Op::Quarantine { lease }),
        1 => any::<Index>().prop_map(|q| Op::ReleaseQuarantined { q }),
        1 => owner.prop_map(|owner| Op::Revoke { owner }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Leased { owner: RequestId, generation: Generation },
    Quarantined { owner: RequestId, generation: Generation },
}

/// What the pool must hold for one page.
#[derive(Clone, Debug)]
struct Page {
    state: State,
    /// Generation of the page's latest lease (0: never leased).
    generation: Generation,
    /// Per layer, the (K, V) rows written in the current generation, f16-rounded.
    rows: Vec<Vec<(Vec<f16>, Vec<f16>)>>,
}

struct Model {
    pages: Vec<Page>,
    granted: u64,
}

impl Model {
    fn new() -> Self {
        let page = Page { state: State::Free, generation: Generation(0), rows: vec![Vec::new(); LAYOUT.layers] };
        Model { pages: vec![page; PAGES], granted: 0 }
    }
    fn count(&self, f: impl Fn(&State) -> bool) -> usize {
        self.pages.iter().filter(|p| f(&p.state)).count()
    }
    fn free(&self) -> usize {
        self.count(|s| *s == State::Free)
    }
    fn page(&mut self, id: PageId) -> &mut Page {
        &mut self.pages[id.0 as usize]
    }
    fn live(&self, l: &Lease) -> bool {
        self.pages[l.page().0 as usize].state == State::Leased { owner: l.owner(), generation: l.generation() }
    }
    fn stale(&self, l: &Lease) -> KvError {
        KvError::StaleLease {
            page: l.page(),
            lease_generation: l.generation(),
            page_generation: self.pages[l.page().0 as usize].generation,
        }
    }
    /// A lease was granted: the page must have been free and the generation must grow.
    fn granted(&mut self, l: &Lease, owner: RequestId) {
        assert_eq!(l.owner(), owner);
        let page = self.page(l.page());
        assert_eq!(page.state, State::Free, "a page is never leased twice at once");
        assert!(l.generation() > page.generation, "generations strictly increase per page");
        page.state = State::Leased { owner, generation: l.generation() };
        page.generation = l.generation();
        page.rows.iter_mut().for_each(Vec::clear);
        self.granted += 1;
    }
    fn freed(&mut self, id: PageId) {
        let page = self.page(id);
        page.state = State::Free;
        page.rows.iter_mut().for_each(Vec::clear);
    }
    fn quarantined(&mut self, q: &Quarantined) {
        let page = self.page(q.page());
        assert_eq!(page.state, State::Leased { owner: q.owner(), generation: q.generation() });
        page.state = State::Quarantined { owner: q.owner(), generation: q.generation() };
        page.rows.iter_mut().for_each(Vec::clear);
    }
}

fn row(seed: i16, salt: f32) -> Vec<f32> {
    (0..ROW).map(|i| f32::from(seed) * 0.013 + salt * i as f32).collect()
}

fn check_step(pool: &KvPool, model: &Model, leases: &[Lease]) {
    pool.check_invariants();
    let s = pool.stats();
    assert_eq!(s.free_pages, model.free());
    assert_eq!(s.leased_pages, model.count(|s| matches!(s, State::Leased { .. })));
    assert_eq!(s.quarantined_pages, model.count(|s| matches!(s, State::Quarantined { .. })));
    assert_eq!(s.leases_granted, model.granted);
    // At most one live handle per page.
    let mut live: Vec<PageId> = leases.iter().filter(|l| model.live(l)).map(|l| l.page()).collect();
    let n = live.len();
    live.sort();
    live.dedup();
    assert_eq!(live.len(), n, "a page is never leased twice at once");
}

fn run(ops: Vec<Op>, poison: bool) {
    let mut pool =
        KvPool::new(PoolConfig { layout: LAYOUT, pages: PAGES, checks: KvChecks { canaries: poison, ..KvChecks::all() } }).unwrap();
    let mut model = Model::new();
    // Every lease handle ever granted and not yet consumed, live or stale.
    let mut leases: Vec<Lease> = Vec::new();
    let mut quarantined: Vec<Quarantined> = Vec::new();

    for op in ops {
        match op {
            Op::Lease { owner } => {
                let owner = RequestId(owner);
                let free = model.free();
                match pool.lease(owner) {
                    Ok(l) => {
                        assert!(free > 0);
                        model.granted(&l, owner);
                        leases.push(l);
                    }
                    Err(e) => assert_eq!((free, e), (0, KvError::Exhausted { requested: 1, free: 0 })),
                }
            }
            Op::LeaseMany { owner, n } => {
                let owner = RequestId(owner);
                let free = model.free();
                match pool.lease_many(owner, n) {
                    Ok(v) => {
                        assert!(n <= free);
                        assert_eq!(v.len(), n);
                        for l in v {
                            model.granted(&l, owner);
                            leases.push(l);
                        }
                    }
                    // All or nothing: stats checked below show nothing was taken.
                    Err(e) => assert_eq!(e, KvError::Exhausted { requested: n, free }),
                }
            }
            Op::Write { lease, layer, slot, seed, bad_len } => {
                if leases.is_empty() {
                    continue;
                }
                let l = &leases[lease.index(leases.len())];
                let page = l.page();
                let watermark = match model.pages[page.0 as usize].rows.get(layer) {
                    Some(rows) => rows.len(),
                    None => 0,
                };
                let slot = slot.unwrap_or(watermark);
                let (k, v) = (row(seed, 0.5), row(seed, -0.25));
                let k_in = if bad_len { &k[..ROW - 1] } else { &k[..] };
                let expected = if !model.live(l) {
                    Err(model.stale(l))
                } else if layer >= LAYOUT.layers {
                    Err(KvError::LayerOutOfRange { layer, layers: LAYOUT.layers })
                } else if bad_len {
                    Err(KvError::RowLength { expected: ROW, k: ROW - 1, v: ROW })
                } else if slot >= LAYOUT.page_size {
                    Err(KvError::PageFull { page, layer, slot, page_size: LAYOUT.page_size })
                } else if slot != watermark {
                    Err(KvError::NonSequentialWrite { page, layer, slot, watermark })
                } else {
                    Ok(())
                };
                assert_eq!(pool.write(l, layer, slot, k_in, &v), expected);
                if expected.is_ok() {
                    let h = |x: &[f32]| x.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
                    model.page(page).rows[layer].push((h(&k), h(&v)));
                }
            }
            Op::Read { lease, layer } => {
                if leases.is_empty() {
                    continue;
                }
                let l = &leases[lease.index(leases.len())];
                if !model.live(l) {
                    assert_eq!(pool.read(l, layer).err(), Some(model.stale(l)));
                    assert_eq!(pool.watermark(l, layer).err(), Some(model.stale(l)));
                    continue;
                }
                if layer >= LAYOUT.layers {
                    let e = KvError::LayerOutOfRange { layer, layers: LAYOUT.layers };
                    assert_eq!(pool.read(l, layer).err(), Some(e));
                    continue;
                }
                let rows = &model.pages[l.page().0 as usize].rows[layer];
                assert_eq!(pool.watermark(l, layer), Ok(rows.len()));
                let r = pool.read(l, layer).unwrap();
                assert_eq!(r.len(), rows.len(), "a read holds exactly the written slots");
                let hd = LAYOUT.head_dim;
                for h in 0..LAYOUT.kv_heads {
                    let bits = |x: &[f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    let want_k: Vec<f16> = rows.iter().flat_map(|(k, _)| k[h * hd..(h + 1) * hd].to_vec()).collect();
                    let want_v: Vec<f16> = rows.iter().flat_map(|(_, v)| v[h * hd..(h + 1) * hd].to_vec()).collect();
                    assert_eq!(bits(r.k_head(h)), bits(&want_k), "K head {h} is exactly what was written");
                    assert_eq!(bits(r.v_head(h)), bits(&want_v), "V head {h} is exactly what was written");
                }
            }
            Op::Release { lease } => {
                if leases.is_empty() {
                    continue;
                }
                let l = leases.swap_remove(lease.index(leases.len()));
                let page = l.page();
                let expected = if model.live(&l) { Ok(()) } else { Err(model.stale(&l)) };
                assert_eq!(pool.release(l), expected);
                if expected.is_ok() {
                    model.freed(page);
                    assert_eq!(pool.page_is_poisoned(page), Ok(poison));
                }
            }
            Op::Quarantine { lease } => {
                if leases.is_empty() {
                    continue;
                }
                let l = leases.swap_remove(lease.index(leases.len()));
                let (page, generation, owner) = (l.page(), l.generation(), l.owner());
                let expected = if model.live(&l) { Ok(()) } else { Err(model.stale(&l)) };
                match pool.quarantine(l) {
                    Ok(q) => {
                        assert_eq!(expected, Ok(()));
                        assert_eq!((q.page(), q.generation(), q.owner()), (page, generation, owner));
                        model.quarantined(&q);
                        quarantined.push(q);
                    }
                    Err(e) => assert_eq!(Err(e), expected),
                }
            }
            Op::ReleaseQuarantined { q } => {
                if quarantined.is_empty() {
                    continue;
                }
                let q = quarantined.swap_remove(q.index(quarantined.len()));
                let page = q.page();
                assert_eq!(pool.release_quarantined(q), Ok(()));
                model.freed(page);
            }
            Op::Revoke { owner } => {
                let owner = RequestId(owner);
                let want: Vec<PageId> = (0..PAGES)
                    .filter(|&i| matches!(model.pages[i].state, State::Leased { owner: o, .. } if o == owner))
                    .map(|i| PageId(i as u32))
                    .collect();
                let qs = pool.revoke_owner(owner);
                assert_eq!(qs.iter().map(|q| q.page()).collect::<Vec<_>>(), want);
                for q in qs {
                    model.quarantined(&q);
                    quarantined.push(q);
                }
            }
        }
        check_step(&pool, &model, &leases);
    }

    // Releasing everything returns the pool to full.
    for l in leases {
        let expected = if model.live(&l) { Ok(()) } else { Err(model.stale(&l)) };
        let page = l.page();
        assert_eq!(pool.release(l), expected);
        if expected.is_ok() {
            model.freed(page);
        }
    }
    for q in quarantined {
        let page = q.page();
        assert_eq!(pool.release_quarantined(q), Ok(()));
        model.freed(page);
    }
    pool.check_invariants();
    let s = pool.stats();
    assert_eq!((s.free_pages, s.leased_pages, s.quarantined_pages), (PAGES, 0, 0));
    assert_eq!(s.releases, s.leases_granted);
    for p in 0..PAGES {
        assert_eq!(pool.page_is_poisoned(PageId(p as u32)), Ok(poison));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_pages_isolated_and_match_the_model(
        ops in proptest::collection::vec(op(), 1..80),
        poison in any::<bool>(),
    ) {
        run(ops, poison);
    }
}
