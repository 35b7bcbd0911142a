//! One core budget for the worker processes on one host: decode steps first.
//!
//! When a prefill and a decode worker share the same cores, each process's compute
//! threads pre-empt the other's, and a pre-empted thread stalls its whole step at the next
//! barrier: a decode step of 20 ms can take 100. The budget makes them take turns, the
//! way Sarathi-Serve's stall-free batching does inside one process:
//!
//! - the decode worker holds the cores for each step ([`DecodeBudget::hold`]): it sends
//!   `HOLD` to every prefill worker of the budget before the step and `RELEASE` after;
//! - a prefill worker's forward pass waits at its next pause point (a [`PausePoint`]:
//!   before each matrix product and attention pass of each layer) while any decode worker
//!   holds, so a decode step shares the cores with at most one region of a prefill step;
//! - while a prefill worker reports work (`BUSY`), the decode worker leaves it the cores
//!   between steps: it starts a step no sooner than `interval` after the previous one
//!   started, nor sooner than a quarter of `interval` after it ended. With no busy
//!   prefill worker, decode steps run back to back as without the budget.
//!
//! So while prompts wait, inter-token latency is about `interval` and prefill gets the rest
//! of it; the budget turns the two processes' contention into a schedule.
//!
//! The budget is a directory of Unix datagram sockets, `prefill-<pid>` and `decode-<pid>`,
//! that only the user can enter (`serve` makes it with mode 0700). Messages are one byte;
//! anything else is ignored. Nothing here decides what is computed, only when: a lost
//! message or a dead peer costs time, never a result. A hold lapses after [`MAX_HOLD`] and a
//! busy report after [`BUSY_LAPSE`], so a decode worker that dies mid-step cannot stop
//! prefill for ever, nor a dead prefill worker slow decode for long.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bulkhead_model::PausePoint;

const HOLD: u8 = b'H';
const RELEASE: u8 = b'R';
const BUSY: u8 = b'B';
const IDLE: u8 = b'I';

/// A hold older than this no longer pauses prefill (a decode worker that died holding).
pub const MAX_HOLD: Duration = Duration::from_millis(500);
/// A busy report older than this no longer paces decode (a prefill worker that died busy).
pub const BUSY_LAPSE: Duration = Duration::from_secs(2);
/// How often a prefill worker repeats an unchanged state to the decode workers it knows.
const REPORT_EVERY: Duration = Duration::from_millis(500);
/// How often a decode worker lists the directory for prefill workers.
const RELIST_EVERY: Duration = Duration::from_secs(1);
/// A prefill worker's report never waits longer than this for a full peer queue.
const SEND_TIMEOUT: Duration = Duration::from_millis(1);

/// Where the budget lives and how decode paces itself while prefill has work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreBudget {
    /// The directory of the budget's sockets, shared by the workers on this host.
    pub dir: PathBuf,
    /// Decode steps start at most this often while a prefill worker has work.
    pub decode_interval: Duration,
}

/// Why a worker could not join a core budget (it then runs without one).
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("cannot bind the core budget's socket {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("cannot start the core budget's listener thread: {0}")]
    Thread(io::Error),
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
    busy: bool,
}

struct Shared {
    state: Mutex<PrefillState>,
    released: Condvar,
    /// Time the forward pass spent waiting at pause points.
    paused_ns: AtomicU64,
}

fn lock(m: &Mutex<PrefillState>) -> MutexGuard<'_, PrefillState> {
    // The state is a few maps, each change complete before the lock is let go.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A prefill worker's side of the budget: the pause point for its model and its reports
/// of whether it has work.
pub struct PrefillBudget {
    ep: Arc<Endpoint>,
    shared: Arc<Shared>,
    /// The last report sent, and when.
    reported: Option<(bool, Instant)>,
}

impl PrefillBudget {
    /// Bind this worker's socket in `dir` and start listening for holds.
    pub fn join(dir: &Path) -> Result<Self, BudgetError> {
        let ep = Arc::new(Endpoint::bind(dir, "prefill")?);
        ep.sock.set_write_timeout(Some(SEND_TIMEOUT)).map_err(|source| BudgetError::Bind { path: ep.path.clone(), source })?;
        let shared = Arc::new(Shared { state: Mutex::default(), released: Condvar::new(), paused_ns: AtomicU64::new(0) });
        let (e, s) = (Arc::clone(&ep), Arc::clone(&shared));
        std::thread::Builder::new().name("core-budget".into()).spawn(move || listen(&e, &s)).map_err(BudgetError::Thread)?;
        Ok(PrefillBudget { ep, shared, reported: None })
    }

    /// The pause point to give the model ([`bulkhead_model::Llama::set_pause_point`]).
    pub fn pause_point(&self) -> Arc<dyn PausePoint> {
        Arc::new(Gate(Arc::clone(&self.shared)))
    }

    /// Tell the decode workers whether this worker has prompts to compute: at once when it
    /// changes, and again every [`REPORT_EVERY`] (a decode worker that started later).
    pub fn report(&mut self, busy: bool) {
        let now = Instant::now();
        if let Some((was, at)) = self.reported
            && was == busy
            && now.duration_since(at) < REPORT_EVERY
        {
            return;
        }
        self.reported = Some((busy, now));
        let peers = {
            let mut s = lock(&self.shared.state);
            s.busy = busy;
            s.peers.clone()
        };
        for p in peers {
            send_state(&self.ep, &self.shared, &p, busy);
        }
    }

    /// Seconds the forward pass has waited for decode steps, in all.
    pub fn paused_seconds(&self) -> f64 {
        self.shared.paused_ns.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// Report `busy` to the decode worker at `peer`; one that is gone is forgotten.
fn send_state(ep: &Endpoint, shared: &Shared, peer: &Path, busy: bool) {
    let msg = [if busy { BUSY } else { IDLE }];
    if let Err(e) = ep.sock.send_to(&msg, peer)
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
        match buf[0] {
            HOLD => {
                s.holds.insert(peer.clone(), Instant::now());
            }
            RELEASE => {
                s.holds.remove(&peer);
                shared.released.notify_all();
            }
            _ => continue,
        }
        if s.peers.insert(peer.clone()) {
            // A decode worker new to us learns our state at once.
            let busy = s.busy;
            drop(s);
            send_state(ep, shared, &peer, busy);
        }
    }
}

/// The prefill model's pause point: wait while any decode worker holds the cores.
struct Gate(Arc<Shared>);

impl PausePoint for Gate {
    fn pause(&self) {
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
}

/// A decode worker's side of the budget.
pub struct DecodeBudget {
    ep: Endpoint,
    dir: PathBuf,
    interval: Duration,
    /// The prefill workers' sockets, as last listed.
    prefills: Vec<PathBuf>,
    listed: Option<Instant>,
    /// Prefill workers that last reported work, and when.
    busy: BTreeMap<PathBuf, Instant>,
    /// When the last step started and ended.
    last: Option<(Instant, Instant)>,
}

impl DecodeBudget {
    /// Bind this worker's socket in the budget's directory.
    pub fn join(b: &CoreBudget) -> Result<Self, BudgetError> {
        let ep = Endpoint::bind(&b.dir, "decode")?;
        ep.sock.set_nonblocking(true).map_err(|source| BudgetError::Bind { path: ep.path.clone(), source })?;
        Ok(DecodeBudget { ep, dir: b.dir.clone(), interval: b.decode_interval, prefills: Vec::new(), listed: None, busy: BTreeMap::new(), last: None })
    }

    /// How long the next step should wait to leave prefill its share (zero: start now).
    pub fn wait(&mut self, now: Instant) -> Duration {
        let mut buf = [0u8; 8];
        while let Ok((n, from)) = self.ep.sock.recv_from(&mut buf) {
            let Some(peer) = from.as_pathname().map(Path::to_path_buf) else { continue };
            match (n, buf[0]) {
                (1, BUSY) => {
                    self.busy.insert(peer, now);
                }
                (1, IDLE) => {
                    self.busy.remove(&peer);
                }
                _ => {}
            }
        }
        self.busy.retain(|_, at| now.duration_since(*at) < BUSY_LAPSE);
        match self.last {
            Some((start, end)) if !self.busy.is_empty() => (start + self.interval).max(end + self.interval / 4).saturating_duration_since(now),
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

    fn budget(dir: &Path, interval_ms: u64) -> CoreBudget {
        CoreBudget { dir: dir.to_path_buf(), decode_interval: Duration::from_millis(interval_ms) }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("bulkhead-budget-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Run `pause` on another thread; the receiver gets a message when it returns.
    fn pause_in_thread(p: Arc<dyn PausePoint>) -> mpsc::Receiver<()> {
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
            let w = d.wait(Instant::now());
            if !w.is_zero() || Instant::now() > deadline {
                return w;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn prefill_pauses_while_decode_holds_and_goes_on_after_release() {
        let dir = temp_dir("hold");
        let mut prefill = PrefillBudget::join(&dir).unwrap();
        let gate = prefill.pause_point();
        let mut decode = DecodeBudget::join(&budget(&dir, 40)).unwrap();
        // No hold: the pause point returns at once.
        pause_in_thread(gate.clone()).recv_timeout(Duration::from_secs(5)).expect("no hold, no wait");
        let held = decode.hold();
        // The listener takes the hold asynchronously; wait until it has.
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock(&prefill.shared.state).holds.is_empty() {
            assert!(Instant::now() < deadline, "the hold never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        let done = pause_in_thread(gate.clone());
        assert!(done.recv_timeout(Duration::from_millis(100)).is_err(), "a prefill pause point went on during a decode step");
        drop(held);
        done.recv_timeout(Duration::from_secs(5)).expect("the release did not end the pause");
        assert!(prefill.paused_seconds() > 0.05, "paused time not counted: {}", prefill.paused_seconds());

        // Decode paces itself only while the prefill worker reports work.
        assert_eq!(decode.wait(Instant::now()), Duration::ZERO, "paced with an idle prefill");
        prefill.report(true);
        let w = until_paced(&mut decode);
        assert!(w > Duration::ZERO && w <= Duration::from_millis(40), "pacing with a busy prefill: {w:?}");
        prefill.report(false);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !decode.wait(Instant::now()).is_zero() {
            assert!(Instant::now() < deadline, "still paced after the prefill worker went idle");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_hold_lapses_when_its_decode_worker_never_releases() {
        let dir = temp_dir("lapse");
        let prefill = PrefillBudget::join(&dir).unwrap();
        let mut decode = DecodeBudget::join(&budget(&dir, 40)).unwrap();
        let held = decode.hold();
        // A decode worker that dies holding never sends its release.
        std::mem::forget(held);
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock(&prefill.shared.state).holds.is_empty() {
            assert!(Instant::now() < deadline, "the hold never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        let started = Instant::now();
        pause_in_thread(prefill.pause_point()).recv_timeout(Duration::from_secs(5)).expect("the hold never lapsed");
        assert!(started.elapsed() <= MAX_HOLD + Duration::from_millis(400));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn garbage_on_the_budget_socket_is_ignored() {
        let dir = temp_dir("garbage");
        let prefill = PrefillBudget::join(&dir).unwrap();
        let stranger = UnixDatagram::unbound().unwrap();
        let target = dir.join(format!("prefill-{}", std::process::id()));
        for msg in [&b"HH"[..], b"", b"x", b"\xff\x00"] {
            stranger.send_to(msg, &target).unwrap();
        }
        // An unnamed sender cannot hold (it could never release).
        stranger.send_to(b"H", &target).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(lock(&prefill.shared.state).holds.is_empty());
        pause_in_thread(prefill.pause_point()).recv_timeout(Duration::from_secs(5)).expect("garbage paused prefill");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
