//! One core budget for the worker processes on one host.
//!
//! When a prefill and a decode worker share the same cores, each process's compute
//! threads pre-empt the other's, and a pre-empted thread stalls its whole step at the next
//! barrier: a decode step of 20 ms can take 100. The budget stops that in one of two ways
//! ([`ShareMode`]):
//!
//! - **split**: while both workers have work, each runs its layers on one compute thread
//!   ([`bulkhead_model::CoreShare::narrow`]), so each has a core to itself and neither
//!   waits for the other; a worker alone uses every core. Decode steps keep an even pace
//!   (no pre-emption) and no core idles while the other worker has work, but a prompt gets
//!   half the cores while any stream decodes, and decode runs far faster than a reader needs.
//! - **pause**: decode steps first, the way Sarathi-Serve's stall-free batching orders
//!   them inside one process. The decode worker holds the cores for each step
//!   ([`DecodeBudget::hold`]); a prefill worker's forward pass waits at its next pause
//!   point (before each matrix product and attention pass of each layer) while any decode
//!   worker holds; and while a prefill worker reports work (`BUSY`), the decode worker
//!   starts a step no sooner than `interval` after the previous one started, nor sooner
//!   than a quarter of `interval` after it ended. Inter-token latency is then about
//!   `interval`, at the cost of the time a small decode step leaves a core idle.
//! - **pause at the SLO's pace** ([`Slo`], `serve --core-budget slo`, the default): pause
//!   mode whose decode steps, while prompts are *late* (the prefill worker has been busy for
//!   half the first-token target), start at most once per three quarters of the per-token
//!   target instead of once per `interval`: decode takes only the per-token latency the SLO
//!   allows and prefill the rest (Sarathi-Serve's stall-free batching, with the pace set by
//!   the SLO). While prompts wait but none is late, half that pace (the plain interval
//!   starved prefill: measured in BENCHMARKS.md). With no prompt waiting decode runs
//!   unpaced on every core.
//!
//! Either way the decode worker sends `HOLD` before each step and `RELEASE` after, and a
//! prefill worker reports `BUSY`, `LATE` or `IDLE`: that is all each side knows of the
//! other.
//!
//! The budget is a directory of Unix datagram sockets, `prefill-<pid>` and `decode-<pid>`,
//! that only the user can enter (`serve` makes it with mode 0700). Messages are one byte;
//! anything else is ignored. Nothing here decides what is computed, only when and on how
//! many threads: a lost message or a dead peer costs time, never a result. A hold lapses
//! after [`MAX_HOLD`] and a busy report after [`BUSY_LAPSE`], so a decode worker that dies
//! mid-step cannot stop or narrow prefill for ever, nor a dead prefill worker slow decode
//! for long.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bulkhead_model::CoreShare;

const HOLD: u8 = b'H';
const RELEASE: u8 = b'R';
const BUSY: u8 = b'B';
const IDLE: u8 = b'I';
const LATE: u8 = b'L';

/// A hold older than this no longer pauses prefill (a decode worker that died holding).
pub const MAX_HOLD: Duration = Duration::from_millis(500);
/// A busy report older than this no longer paces or narrows decode (a prefill worker that
/// died busy).
pub const BUSY_LAPSE: Duration = Duration::from_secs(2);
/// In split mode, prefill stays narrow this long after a decode step was last seen: decode
/// steps follow each other with gaps of about a millisecond while sequences decode.
const DECODE_LAPSE: Duration = Duration::from_millis(10);
/// How often a prefill worker repeats an unchanged state to the decode workers it knows.
const REPORT_EVERY: Duration = Duration::from_millis(500);
/// How often a decode worker lists the directory for prefill workers.
const RELIST_EVERY: Duration = Duration::from_secs(1);
/// A prefill worker's report never waits longer than this for a full peer queue.
const SEND_TIMEOUT: Duration = Duration::from_millis(1);

/// Help text of `bulkhead:narrowed_layers_total`, which both workers report.
pub const NARROWED_HELP: &str =
    "Layers the forward pass ran on one compute thread while the other worker on this host had work (core budget, split mode).";

/// How the workers on one host share its cores while both have work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareMode {
    /// Each runs on one compute thread.
    Split,
    /// Prefill pauses during decode steps, which are paced by the interval.
    Pause,
}

/// Where the budget lives and how the workers share the cores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreBudget {
    /// The directory of the budget's sockets, shared by the workers on this host.
    pub dir: PathBuf,
    /// How the cores are shared while both workers have work.
    pub mode: ShareMode,
    /// Pause mode: decode steps start at most this often while a prefill worker has work.
    pub decode_interval: Duration,
    /// Pause mode: targets that set the decode pace while prompts are late.
    pub slo: Option<Slo>,
}

/// Service-level targets that pace decode (`serve --slo-tpot-ms`, `--slo-ttft-ms`; the chat
/// pair, 100 ms and 2.5 s, by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slo {
    /// Time per output token: while a prompt is late, decode steps start at most once per
    /// [`Slo::pace`].
    pub tpot: Duration,
    /// Time to first token: prompts are late once the prefill worker has been busy for half
    /// of this without a pause (the other half is left for a prompt's compute and the way to
    /// the client).
    pub ttft: Duration,
}

impl Slo {
    /// The decode pace while prompts are late: three quarters of the per-token target, the
    /// rest a margin for a step that runs long and for the token's way to the client.
    pub fn pace(&self) -> Duration {
        self.tpot * 3 / 4
    }

    /// Whether a prompt that has waited `waited` is late.
    pub fn late(&self, waited: Duration) -> bool {
        waited >= self.ttft / 2
    }
}

/// What a prefill worker tells the decode workers of its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Work {
    /// No prompt waits.
    #[default]
    Idle,
    /// Prompts wait.
    Busy,
    /// Prompts have queued past their share of the first-token target ([`Slo::late`]).
    Late,
}

impl Work {
    fn byte(self) -> u8 {
        match self {
            Work::Idle => IDLE,
            Work::Busy => BUSY,
            Work::Late => LATE,
        }
    }
}

/// Why a worker could not join a core budget (it then runs without one).
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("cannot bind the core budget's socket {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("cannot start the core budget's listener thread: {0}")]
    Thread(io::Error),
    #[error("cannot give the model its core share: {0}")]
    Model(#[from] bulkhead_model::ModelError),
}

/// Log how a worker joined the budget `b` (or why it runs without one) and pass the result on.
pub fn joined<T>(b: &CoreBudget, role: &str, r: Result<T, BudgetError>) -> Option<T> {
    match r {
        Ok(t) => {
            let dir = b.dir.display();
            match b.mode {
                ShareMode::Split => {
                    tracing::info!(role, %dir, "core budget split: each worker runs on one thread while the other has work")
                }
                ShareMode::Pause => {
                    let interval_ms = b.decode_interval.as_millis() as u64;
                    match b.slo {
                        None => {
                            tracing::info!(role, %dir, interval_ms, "core budget pause: prefill pauses during decode steps, which keep the interval while prefill has work")
                        }
                        Some(slo) => {
                            let pace_ms = slo.pace().as_millis() as u64;
                            let late_after_ms = (slo.ttft / 2).as_millis() as u64;
                            tracing::info!(role, %dir, pace_ms, late_after_ms, "core budget paced by the SLO: prefill pauses during decode steps, which keep the SLO's pace while a prompt is late and half of it while prompts wait")
                        }
                    }
                }
            }
            Some(t)
        }
        Err(e) => {
            tracing::warn!(role, error = %e, "running without the core budget");
            None
        }
    }
}

/// A socket bound in the budget's directory, removed when dropped.
struct Endpoint {
    sock: UnixDatagram,
    path: PathBuf,
}

impl Endpoint {
    fn bind(dir: &Path, role: &str) -> Result<Self, BudgetError> {
        let path = dir.join(format!("{role}-{}", std::process::id()));
        // A file left by an earlier process with this pid; nobody can be bound to it now.
        let _ = std::fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path).map_err(|source| BudgetError::Bind { path: path.clone(), source })?;
        Ok(Endpoint { sock, path })
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What a prefill worker's listener knows, shared with its pause point.
#[derive(Default)]
struct PrefillState {
    /// Decode workers holding the cores, with when each hold began.
    holds: BTreeMap<PathBuf, Instant>,
    /// Decode workers that have spoken: they get this worker's reports.
    peers: BTreeSet<PathBuf>,
    /// The last state reported.
    work: Work,
    /// When a decode worker last held or released the cores.
    decode_seen: Option<Instant>,
}

struct Shared {
    mode: ShareMode,
    state: Mutex<PrefillState>,
    released: Condvar,
    /// Time the forward pass spent waiting at pause points.
    paused_ns: AtomicU64,
    /// Layers the forward pass ran on one thread.
    narrowed: AtomicU64,
}

fn lock(m: &Mutex<PrefillState>) -> MutexGuard<'_, PrefillState> {
    // The state is a few maps, each change complete before the lock is let go.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A prefill worker's side of the budget: the core share for its model and its reports of
/// whether it has work.
pub struct PrefillBudget {
    ep: Arc<Endpoint>,
    shared: Arc<Shared>,
    slo: Option<Slo>,
    /// The last report sent, and when.
    reported: Option<(Work, Instant)>,
}

impl PrefillBudget {
    /// Bind this worker's socket in `b.dir` and start listening for holds.
    pub fn join(b: &CoreBudget) -> Result<Self, BudgetError> {
        let ep = Arc::new(Endpoint::bind(&b.dir, "prefill")?);
        ep.sock.set_write_timeout(Some(SEND_TIMEOUT)).map_err(|source| BudgetError::Bind { path: ep.path.clone(), source })?;
        let shared = Arc::new(Shared {
            mode: b.mode,
            state: Mutex::default(),
            released: Condvar::new(),
            paused_ns: AtomicU64::new(0),
            narrowed: AtomicU64::new(0),
        });
        let (e, s) = (Arc::clone(&ep), Arc::clone(&shared));
        std::thread::Builder::new().name("core-budget".into()).spawn(move || listen(&e, &s)).map_err(BudgetError::Thread)?;
        Ok(PrefillBudget { ep, shared, slo: b.slo, reported: None })
    }

    /// The core share to give the model ([`bulkhead_model::Llama::set_core_share`]).
    pub fn core_share(&self) -> Arc<dyn CoreShare> {
        Arc::new(Gate(Arc::clone(&self.shared)))
    }

    /// Tell the decode workers whether this worker has prompts to compute, given how long
    /// it has been busy (none: no prompt waits), and whether prompts are late for the SLO:
    /// at once when that changes, and again every [`REPORT_EVERY`] (a decode worker that
    /// started later).
    pub fn report(&mut self, busy_for: Option<Duration>) {
        let work = match (busy_for, self.slo) {
            (None, _) => Work::Idle,
            (Some(w), Some(slo)) if slo.late(w) => Work::Late,
            (Some(_), _) => Work::Busy,
        };
        let now = Instant::now();
        if let Some((was, at)) = self.reported
            && was == work
            && now.duration_since(at) < REPORT_EVERY
        {
            return;
        }
        self.reported = Some((work, now));
        let peers = {
            let mut s = lock(&self.shared.state);
            s.work = work;
            s.peers.clone()
        };
        for p in peers {
            send_state(&self.ep, &self.shared, &p, work);
        }
    }

    /// Seconds the forward pass has waited for decode steps, in all (pause mode).
    pub fn paused_seconds(&self) -> f64 {
        self.shared.paused_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Layers the forward pass has run on one thread, in all (split mode).
    pub fn narrowed_layers(&self) -> u64 {
        self.shared.narrowed.load(Ordering::Relaxed)
    }
}

impl Drop for PrefillBudget {
    fn drop(&mut self) {
        // The listener thread keeps the socket open for the life of the process, so its
        // endpoint is never dropped: take the name away here, as the worker leaves.
        let _ = std::fs::remove_file(&self.ep.path);
    }
}

/// Report `work` to the decode worker at `peer`; one that is gone is forgotten.
fn send_state(ep: &Endpoint, shared: &Shared, peer: &Path, work: Work) {
    if let Err(e) = ep.sock.send_to(&[work.byte()], peer)
        && matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused)
    {
        lock(&shared.state).peers.remove(peer);
    }
}

/// The listener thread: holds and releases from decode workers.
fn listen(ep: &Endpoint, shared: &Shared) {
    let mut buf = [0u8; 8];
    loop {
        let (n, from) = match ep.sock.recv_from(&mut buf) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "core budget listener stopped: prefill no longer pauses for decode steps");
                lock(&shared.state).holds.clear();
                shared.released.notify_all();
                return;
            }
        };
        let Some(peer) = from.as_pathname().map(Path::to_path_buf) else { continue };
        if n != 1 {
            continue;
        }
        let mut s = lock(&shared.state);
        let now = Instant::now();
        match buf[0] {
            HOLD => {
                s.holds.insert(peer.clone(), now);
            }
            RELEASE => {
                s.holds.remove(&peer);
                shared.released.notify_all();
            }
            _ => continue,
        }
        s.decode_seen = Some(now);
        if s.peers.insert(peer.clone()) {
            // A decode worker new to us learns our state at once.
            let work = s.work;
            drop(s);
            send_state(ep, shared, &peer, work);
        }
    }
}

/// The prefill model's core share: in pause mode, wait while any decode worker holds the
/// cores; in split mode, narrow while a decode worker is stepping.
struct Gate(Arc<Shared>);

impl CoreShare for Gate {
    fn pause(&self) {
        if self.0.mode != ShareMode::Pause {
            return;
        }
        let mut s = lock(&self.0.state);
        let mut waited = None;
        loop {
            let now = Instant::now();
            s.holds.retain(|_, at| now.duration_since(*at) < MAX_HOLD);
            let Some(lapse) = s.holds.values().map(|at| *at + MAX_HOLD).min() else { break };
            waited.get_or_insert(now);
            s = match self.0.released.wait_timeout(s, lapse.duration_since(now)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        if let Some(since) = waited {
            self.0.paused_ns.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    fn narrow(&self) -> bool {
        if self.0.mode != ShareMode::Split {
            return false;
        }
        let now = Instant::now();
        let s = lock(&self.0.state);
        let stepping = s.holds.values().any(|at| now.duration_since(*at) < MAX_HOLD)
            || s.decode_seen.is_some_and(|at| now.duration_since(at) < DECODE_LAPSE);
        drop(s);
        if stepping {
            self.0.narrowed.fetch_add(1, Ordering::Relaxed);
        }
        stepping
    }
}

/// The decode model's core share: narrow while a prefill worker reports work (split mode),
/// as the decode worker last found before its step. It never pauses.
#[derive(Default)]
pub struct DecodeShare {
    narrow: AtomicBool,
    narrowed: AtomicU64,
    slo_paced: AtomicU64,
}

impl DecodeShare {
    /// Layers the decode model has run on one thread, in all (split mode).
    pub fn narrowed_layers(&self) -> u64 {
        self.narrowed.load(Ordering::Relaxed)
    }

    /// Decode steps started at the SLO's pace because a prompt was late, in all.
    pub fn slo_paced_steps(&self) -> u64 {
        self.slo_paced.load(Ordering::Relaxed)
    }
}

/// Help text of `bulkhead:slo_paced_steps_total`.
pub const SLO_PACED_HELP: &str = "Decode steps started at the per-token SLO's pace because a prompt waited past its share of the first-token SLO (core budget paced by the SLO).";

impl CoreShare for DecodeShare {
    fn pause(&self) {}

    fn narrow(&self) -> bool {
        let n = self.narrow.load(Ordering::Relaxed);
        if n {
            self.narrowed.fetch_add(1, Ordering::Relaxed);
        }
        n
    }
}

/// A decode worker's side of the budget.
pub struct DecodeBudget {
    ep: Endpoint,
    dir: PathBuf,
    mode: ShareMode,
    interval: Duration,
    slo: Option<Slo>,
    share: Arc<DecodeShare>,
    /// The prefill workers' sockets, as last listed.
    prefills: Vec<PathBuf>,
    listed: Option<Instant>,
    /// Prefill workers that last reported work, when, and whether a prompt of theirs is late.
    busy: BTreeMap<PathBuf, (Instant, bool)>,
    /// Whether the step about to start keeps the SLO's pace.
    slo_paced: bool,
    /// When the last step started and ended.
    last: Option<(Instant, Instant)>,
}

impl DecodeBudget {
    /// Bind this worker's socket in the budget's directory.
    pub fn join(b: &CoreBudget) -> Result<Self, BudgetError> {
        let ep = Endpoint::bind(&b.dir, "decode")?;
        ep.sock.set_nonblocking(true).map_err(|source| BudgetError::Bind { path: ep.path.clone(), source })?;
        Ok(DecodeBudget {
            ep,
            dir: b.dir.clone(),
            mode: b.mode,
            interval: b.decode_interval,
            slo: b.slo,
            share: Arc::default(),
            prefills: Vec::new(),
            listed: None,
            busy: BTreeMap::new(),
            slo_paced: false,
            last: None,
        })
    }

    /// The core share to give the model ([`bulkhead_model::Llama::set_core_share`]): it
    /// narrows the steps [`DecodeBudget::wait`] finds a busy prefill worker for.
    pub fn core_share(&self) -> Arc<DecodeShare> {
        self.share.clone()
    }

    /// How long the next step should wait to leave prefill its share (zero: start now;
    /// always zero in split mode, where it sets whether the step runs narrow). `tokens` is
    /// the fewest tokens a sequence got from the last step (more than one where speculation's
    /// drafts were accepted): the pace counts tokens, not steps, so a step that gave every
    /// sequence three tokens may be followed three paces later.
    pub fn wait(&mut self, now: Instant, tokens: usize) -> Duration {
        let mut buf = [0u8; 8];
        while let Ok((n, from)) = self.ep.sock.recv_from(&mut buf) {
            let Some(peer) = from.as_pathname().map(Path::to_path_buf) else { continue };
            match (n, buf[0]) {
                (1, BUSY) => {
                    self.busy.insert(peer, (now, false));
                }
                (1, LATE) => {
                    self.busy.insert(peer, (now, true));
                }
                (1, IDLE) => {
                    self.busy.remove(&peer);
                }
                _ => {}
            }
        }
        self.busy.retain(|_, (at, _)| now.duration_since(*at) < BUSY_LAPSE);
        let prefill_busy = !self.busy.is_empty();
        self.share.narrow.store(self.mode == ShareMode::Split && prefill_busy, Ordering::Relaxed);
        let late = self.busy.values().any(|(_, late)| *late);
        let interval = match self.slo {
            Some(slo) if late => slo.pace(),
            Some(slo) => slo.pace() / 2,
            None => self.interval,
        } * u32::try_from(tokens.max(1)).unwrap_or(u32::MAX);
        self.slo_paced = late && self.slo.is_some() && self.mode == ShareMode::Pause;
        match self.last {
            Some((start, end)) if prefill_busy && self.mode == ShareMode::Pause => {
                (start + interval).max(end + interval / 4).saturating_duration_since(now)
            }
            _ => Duration::ZERO,
        }
    }

    /// Hold the cores for one step: prefill workers pause until the guard is dropped.
    pub fn hold(&mut self) -> Held<'_> {
        let now = Instant::now();
        if self.listed.is_none_or(|at| now.duration_since(at) >= RELIST_EVERY) {
            self.relist();
            self.listed = Some(now);
        }
        self.send(HOLD);
        if self.slo_paced {
            self.share.slo_paced.fetch_add(1, Ordering::Relaxed);
        }
        Held { budget: self, started: now }
    }

    fn relist(&mut self) {
        self.prefills.clear();
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for e in entries.flatten() {
            if e.file_name().to_str().is_some_and(|n| n.starts_with("prefill-")) {
                self.prefills.push(e.path());
            }
        }
    }

    fn send(&mut self, msg: u8) {
        // A full queue (a stalled prefill worker) drops the message: holds lapse anyway.
        self.prefills.retain(|p| match self.ep.sock.send_to(&[msg], p) {
            Err(e) => !matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused),
            Ok(_) => true,
        });
    }
}

/// The cores held for one decode step; dropping it releases them.
pub struct Held<'b> {
    budget: &'b mut DecodeBudget,
    started: Instant,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.budget.send(RELEASE);
        self.budget.last = Some((self.started, Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn budget(dir: &Path, mode: ShareMode, interval_ms: u64) -> CoreBudget {
        CoreBudget { dir: dir.to_path_buf(), mode, decode_interval: Duration::from_millis(interval_ms), slo: None }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("bulkhead-budget-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A prefill and a decode worker's sides of one budget in `mode`, in a fresh directory.
    fn pair(name: &str, mode: ShareMode) -> (PathBuf, PrefillBudget, DecodeBudget) {
        let dir = temp_dir(name);
        let prefill = PrefillBudget::join(&budget(&dir, mode, 40)).unwrap();
        let decode = DecodeBudget::join(&budget(&dir, mode, 40)).unwrap();
        (dir, prefill, decode)
    }

    /// Run `pause` on another thread; the receiver gets a message when it returns.
    fn pause_in_thread(p: Arc<dyn CoreShare>) -> mpsc::Receiver<()> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            p.pause();
            let _ = tx.send(());
        });
        rx
    }

    /// Wait until the decode side has heard `busy` from the prefill worker.
    fn until_paced(d: &mut DecodeBudget) -> Duration {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let w = d.wait(Instant::now(), 1);
            if !w.is_zero() || Instant::now() > deadline {
                return w;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Wait until `cond` holds, for at most five seconds.
    fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn prefill_pauses_while_decode_holds_and_goes_on_after_release() {
        let (dir, mut prefill, mut decode) = pair("hold", ShareMode::Pause);
        let gate = prefill.core_share();
        // No hold: the pause point returns at once.
        pause_in_thread(gate.clone()).recv_timeout(Duration::from_secs(5)).expect("no hold, no wait");
        let held = decode.hold();
        // The listener takes the hold asynchronously; wait until it has.
        eventually("the hold never arrived", || !lock(&prefill.shared.state).holds.is_empty());
        let done = pause_in_thread(gate.clone());
        assert!(done.recv_timeout(Duration::from_millis(100)).is_err(), "a prefill pause point went on during a decode step");
        drop(held);
        done.recv_timeout(Duration::from_secs(5)).expect("the release did not end the pause");
        assert!(prefill.paused_seconds() > 0.05, "paused time not counted: {}", prefill.paused_seconds());

        // Decode paces itself only while the prefill worker reports work.
        assert_eq!(decode.wait(Instant::now(), 1), Duration::ZERO, "paced with an idle prefill");
        prefill.report(Some(Duration::ZERO));
        let w = until_paced(&mut decode);
        assert!(w > Duration::ZERO && w <= Duration::from_millis(40), "pacing with a busy prefill: {w:?}");
        prefill.report(None);
        eventually("still paced after the prefill worker went idle", || decode.wait(Instant::now(), 1).is_zero());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn in_split_mode_each_worker_narrows_while_the_other_works_and_nothing_pauses() {
        let (dir, mut prefill, mut decode) = pair("split", ShareMode::Split);
        let gate = prefill.core_share();
        let decode_share = decode.core_share();
        assert!(!gate.narrow(), "prefill narrow with no decode worker stepping");
        // A decode step narrows prefill's layers and pauses nothing.
        let held = decode.hold();
        eventually("the hold never narrowed prefill", || gate.narrow());
        pause_in_thread(gate.clone()).recv_timeout(Duration::from_secs(5)).expect("split mode paused prefill");
        drop(held);
        eventually("prefill stayed narrow after decode stopped stepping", || !gate.narrow());
        assert!(prefill.narrowed_layers() > 0 && prefill.paused_seconds() == 0.0);
        // Decode narrows its steps while prefill reports work, and never waits.
        assert!(!decode_share.narrow(), "decode narrow with an idle prefill");
        prefill.report(Some(Duration::ZERO));
        eventually("a busy prefill never narrowed decode", || decode.wait(Instant::now(), 1).is_zero() && decode_share.narrow());
        drop(decode.hold());
        assert_eq!(decode.wait(Instant::now(), 1), Duration::ZERO, "split mode paced decode");
        prefill.report(None);
        eventually("decode stayed narrow after prefill went idle", || {
            decode.wait(Instant::now(), 1);
            !decode_share.narrow()
        });
        assert!(decode_share.narrowed_layers() > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn with_an_slo_decode_keeps_its_pace_only_while_a_prompt_is_late() {
        let dir = temp_dir("slo");
        let slo = Slo { tpot: Duration::from_millis(400), ttft: Duration::from_millis(1000) };
        let b = CoreBudget { slo: Some(slo), ..budget(&dir, ShareMode::Pause, 20) };
        let (mut prefill, mut decode) = (PrefillBudget::join(&b).unwrap(), DecodeBudget::join(&b).unwrap());
        // How long the next step waits, right after a step.
        let after_a_step = |d: &mut DecodeBudget| {
            drop(d.hold());
            d.wait(Instant::now(), 1)
        };
        // A prompt that has waited less than half the first-token target: half the pace.
        prefill.report(Some(Duration::from_millis(100)));
        eventually("a busy prefill never paced decode at half the SLO's pace", || after_a_step(&mut decode) > Duration::from_millis(100));
        let w = after_a_step(&mut decode);
        assert!(w <= Duration::from_millis(150), "paced past half the SLO's pace with no prompt late: {w:?}");
        assert_eq!(decode.share.slo_paced_steps(), 0);
        // Half the target gone: the SLO's pace, three quarters of the per-token target.
        prefill.report(Some(Duration::from_millis(500)));
        eventually("a late prompt never slowed decode to the SLO's pace", || after_a_step(&mut decode) > Duration::from_millis(200));
        let w = after_a_step(&mut decode);
        assert!(w <= Duration::from_millis(300), "paced past the SLO's pace: {w:?}");
        assert!(decode.share.slo_paced_steps() > 0, "steps at the SLO's pace not counted");
        // A step that gave every sequence three tokens (accepted drafts) is followed three
        // paces later: the pace counts tokens, not steps.
        drop(decode.hold());
        let w = decode.wait(Instant::now(), 3);
        assert!(w > Duration::from_millis(800) && w <= Duration::from_millis(900), "three tokens paced as {w:?}");
        prefill.report(None);
        eventually("still paced after the prefill worker went idle", || after_a_step(&mut decode).is_zero());
        // Late at half the first-token target, not before.
        assert!(slo.late(Duration::from_millis(500)) && !slo.late(Duration::from_millis(499)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_hold_lapses_when_its_decode_worker_never_releases() {
        let (dir, prefill, mut decode) = pair("lapse", ShareMode::Pause);
        let held = decode.hold();
        // A decode worker that dies holding never sends its release.
        std::mem::forget(held);
        eventually("the hold never arrived", || !lock(&prefill.shared.state).holds.is_empty());
        let started = Instant::now();
        pause_in_thread(prefill.core_share()).recv_timeout(Duration::from_secs(5)).expect("the hold never lapsed");
        assert!(started.elapsed() <= MAX_HOLD + Duration::from_millis(400));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn garbage_on_the_budget_socket_is_ignored() {
        let dir = temp_dir("garbage");
        let prefill = PrefillBudget::join(&budget(&dir, ShareMode::Pause, 40)).unwrap();
        let stranger = UnixDatagram::unbound().unwrap();
        let target = dir.join(format!("prefill-{}", std::process::id()));
        for msg in [&b"HH"[..], b"", b"x", b"\xff\x00"] {
            stranger.send_to(msg, &target).unwrap();
        }
        // An unnamed sender cannot hold (it could never release).
        stranger.send_to(b"H", &target).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(lock(&prefill.shared.state).holds.is_empty());
        pause_in_thread(prefill.core_share()).recv_timeout(Duration::from_secs(5)).expect("garbage paused prefill");
        // A worker that leaves takes its socket's name with it.
        drop(prefill);
        assert!(!target.exists(), "the prefill socket outlived its worker");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
