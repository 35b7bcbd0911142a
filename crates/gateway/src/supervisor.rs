//! The worker processes `serve --role all` starts on one host (and its extra gateways):
//! each restarted with backoff as it exits; given up on, naming why, when it crash-loops or
//! says it cannot start ([`EXIT_CANNOT_START`]); killed when the supervisor is dropped.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The exit status of a `serve` process that cannot start for a reason a restart does not
/// change (sysexits' `EX_CONFIG`): its settings, its files, the capacity check. A
/// supervisor gives up on such a child at once.
pub const EXIT_CANNOT_START: i32 = 78;

/// Why the supervisor gave up, or could not start a child.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// A child said it cannot start ([`EXIT_CANNOT_START`], or 2: a command line that does
    /// not parse); `how` is its status and its last error line.
    #[error("the {role} worker cannot start ({how}); a restart would fail the same way, so serve stops")]
    CannotStart { role: String, how: String },
    /// A child exited [`CRASH_LOOP_EXITS`] times within [`CRASH_LOOP_WINDOW`].
    #[error("the {role} worker exited {exits} times within {} s (last: {how}); giving up so that an outer supervisor can take over", CRASH_LOOP_WINDOW.as_secs())]
    CrashLoop { role: String, exits: usize, how: String },
    /// A child that names its addresses on its first line printed none in time.
    #[error("it printed no address within {0} s (its log says why)")]
    NoAddress(u64),
    /// Starting a child, or the core budget's directory.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Exits of one worker within [`CRASH_LOOP_WINDOW`] that end the server: restarting it
/// again would only hide the fault from an outer supervisor (Kubernetes, systemd).
const CRASH_LOOP_EXITS: usize = 5;
const CRASH_LOOP_WINDOW: Duration = Duration::from_secs(60);
/// Restart delay after the first exit; doubles with each recent exit, up to the maximum.
const RESTART_BACKOFF: Duration = Duration::from_millis(100);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often children are checked for exits (which also reaps them).
const SUPERVISE_EVERY: Duration = Duration::from_millis(100);

/// One worker process of `serve --role all` and its restarts.
struct Slot {
    /// What it is, in logs: `prefill`, `decode`, `gateway-1`, ….
    role: String,
    cmd: Command,
    /// Written to its standard input at every start.
    input: String,
    child: Option<Child>,
    /// Its standard input, held open while it runs: a gateway child exits when it closes.
    stdin: Option<ChildStdin>,
    /// Forwards its standard error to ours; ends with its last `error:` line.
    errors: Option<Errors>,
    /// Recent exits, oldest first, within the crash-loop window.
    exits: VecDeque<Instant>,
    restart_at: Option<Instant>,
}

/// The worker processes: each restarted with backoff when it exits (it registers again
/// under a new id; the pages its old incarnation held are fenced by the protocol), reaped
/// as it exits, and killed when this is dropped.
#[derive(Default)]
pub struct Supervisor {
    slots: Vec<Slot>,
}

/// A started child's place in its [`Supervisor`].
#[derive(Clone, Copy, Debug)]
pub struct SlotId(usize);

impl Supervisor {
    /// Start `cmd` as `role` (in logs), writing `input` to its standard input at this and
    /// every later start (its settings and the cluster key: never on a command line or in
    /// the environment), and keep restarting it as it exits.
    pub fn add(&mut self, role: String, mut cmd: Command, input: String) -> std::io::Result<SlotId> {
        let (child, stdin, errors) = spawn(&mut cmd, &input)?;
        self.slots.push(Slot { role, cmd, input, child: Some(child), stdin, errors, exits: VecDeque::new(), restart_at: None });
        Ok(SlotId(self.slots.len() - 1))
    }

    /// [`Supervisor::add`] for a child that names its addresses on its first line of
    /// standard output (a gateway): that line, read within `within`. The rest of its output
    /// is drained, and a restart's is not read.
    pub fn add_announcing(
        &mut self,
        role: String,
        mut cmd: Command,
        input: String,
        within: Duration,
    ) -> Result<(SlotId, String), SupervisorError> {
        cmd.stdout(Stdio::piped());
        let id = self.add(role, cmd, input)?;
        let slot = &mut self.slots[id.0];
        slot.cmd.stdout(Stdio::null());
        let out = slot.child.as_mut().and_then(|c| c.stdout.take()).ok_or_else(|| std::io::Error::other("no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        match rx.recv_timeout(within) {
            Ok(line) => Ok((id, line)),
            Err(_) => Err(SupervisorError::NoAddress(within.as_secs())),
        }
    }

    /// The process id of `slot`'s child now, if it runs.
    pub fn pid(&self, slot: SlotId) -> Option<u32> {
        self.slots[slot.0].child.as_ref().map(Child::id)
    }

    /// What `slot` is given on its standard input from its next restart on (a gateway
    /// keeps the ports its first start chose).
    pub fn set_input(&mut self, slot: SlotId, input: String) {
        self.slots[slot.0].input = input;
    }

    /// Restart workers as they exit; returns only when one crash-loops or cannot start.
    pub async fn supervise(&mut self) -> SupervisorError {
        loop {
            tokio::time::sleep(SUPERVISE_EVERY).await;
            if let Err(e) = self.poll(Instant::now()) {
                tracing::error!(error = %e, "worker crash loop");
                return e;
            }
        }
    }

    fn poll(&mut self, now: Instant) -> Result<(), SupervisorError> {
        for slot in &mut self.slots {
            let exited = match slot.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some((status.to_string(), status.code())),
                Some(Err(e)) => Some((format!("cannot wait for it: {e}"), None)),
                Some(Ok(None)) | None => None,
            };
            if let Some((status, code)) = exited {
                slot.child = None;
                let cause = slot.errors.take().and_then(Errors::last);
                let how = cause.as_ref().map_or_else(|| status.clone(), |c| format!("{status}: {c}"));
                // Its own word that a restart fails the same way, or a command line that
                // does not parse (clap's 2): give up now, naming why.
                if matches!(code, Some(EXIT_CANNOT_START | 2)) {
                    return Err(SupervisorError::CannotStart { role: slot.role.clone(), how });
                }
                slot.exited(now, &how)?;
            }
            if slot.child.is_none() && slot.restart_at.is_some_and(|t| t <= now) {
                slot.restart_at = None;
                match spawn(&mut slot.cmd, &slot.input) {
                    Ok((c, stdin, errors)) => {
                        tracing::info!(role = %slot.role, pid = c.id(), "{} restarted", slot.role);
                        slot.child = Some(c);
                        slot.stdin = stdin;
                        slot.errors = errors;
                    }
                    // A worker that cannot even be started crash-loops too.
                    Err(e) => slot.exited(now, &format!("cannot start it: {e}"))?,
                }
            }
        }
        Ok(())
    }
}

impl Slot {
    /// Its process is gone: schedule a restart, or give up if it keeps exiting.
    fn exited(&mut self, now: Instant, how: &str) -> Result<(), SupervisorError> {
        self.exits.push_back(now);
        while self.exits.front().is_some_and(|t| now.duration_since(*t) > CRASH_LOOP_WINDOW) {
            self.exits.pop_front();
        }
        let n = self.exits.len();
        if n >= CRASH_LOOP_EXITS {
            return Err(SupervisorError::CrashLoop { role: self.role.clone(), exits: n, how: how.to_string() });
        }
        let backoff = RESTART_BACKOFF.saturating_mul(1 << (n - 1)).min(RESTART_BACKOFF_MAX);
        tracing::warn!(role = self.role, status = how, backoff_ms = backoff.as_millis() as u64, "worker exited; restarting it");
        self.restart_at = Some(now + backoff);
        Ok(())
    }
}

/// The core budget's directory for the workers of `serve --role all`: made private to this
/// user, removed when dropped.
pub struct BudgetDir(PathBuf);

/// Name prefix of the core budget's directories in the temporary directory.
pub const BUDGET_DIR_PREFIX: &str = "bulkhead-cores-";

impl BudgetDir {
    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// A new directory for this process's workers' core budget.
    pub fn new() -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let tmp = std::env::temp_dir();
        sweep_budget_dirs(&tmp);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = tmp.join(format!("{BUDGET_DIR_PREFIX}{}-{nanos:x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot make the core budget's directory {}: {e}", dir.display())))?;
        Ok(BudgetDir(dir))
    }
}

/// Remove this user's core budget directories in `tmp` whose `serve` process is gone: one
/// killed (SIGKILL) never dropped its [`BudgetDir`]. A directory whose process id is alive,
/// or whose liveness cannot be told (no `/proc`), is kept. (A `/tmp` shared by the same
/// user between pid namespaces defeats the liveness test: a `serve` in another namespace
/// would lose its budget's sockets. Give each its own `TMPDIR` there.)
pub fn sweep_budget_dirs(tmp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else { return };
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(BUDGET_DIR_PREFIX))
            .and_then(|r| r.split_once('-'))
            .and_then(|(p, _)| p.parse::<u32>().ok())
        else {
            continue;
        };
        let mine = e.metadata().is_ok_and(|m| m.uid() == me);
        if mine && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

impl Drop for BudgetDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child's standard error, copied line by line to ours by a thread that keeps the last
/// line the child's `main` printed for the error it exits with.
struct Errors(std::thread::JoinHandle<Option<String>>);

impl Errors {
    fn forward(from: std::process::ChildStderr) -> Errors {
        Errors(std::thread::spawn(move || {
            use std::io::BufRead;
            let mut last = None;
            for line in std::io::BufReader::new(from).lines().map_while(Result::ok) {
                eprintln!("{line}");
                if let Some(e) = line.strip_prefix("error: ") {
                    last = Some(e.to_string());
                }
            }
            last
        }))
    }

    /// The child's last error line, once its standard error closed (it exited).
    fn last(self) -> Option<String> {
        self.0.join().ok().flatten()
    }
}

/// Start a child, writing `input` to its standard input, which stays open while it runs.
fn spawn(cmd: &mut Command, input: &str) -> std::io::Result<(Child, Option<ChildStdin>, Option<Errors>)> {
    cmd.stderr(Stdio::piped()).stdin(Stdio::piped());
    let mut child = cmd.spawn()?;
    let errors = child.stderr.take().map(Errors::forward);
    let sent =
        child.stdin.take().ok_or_else(|| std::io::Error::other("no stdin")).and_then(|mut i| i.write_all(input.as_bytes()).map(|()| i));
    match sent {
        Ok(stdin) => Ok((child, Some(stdin), errors)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for c in self.slots.iter_mut().filter_map(|s| s.child.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_dirs_of_dead_serve_processes_are_swept_and_live_ones_kept() {
        let tmp = std::env::temp_dir().join(format!("bulkhead-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        // A process id that was alive and is gone: a reaped child's.
        let mut child = Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let dead_dir = tmp.join(format!("{BUDGET_DIR_PREFIX}{dead}-1f"));
        let live_dir = tmp.join(format!("{BUDGET_DIR_PREFIX}{}-2f", std::process::id()));
        let other = tmp.join(format!("{BUDGET_DIR_PREFIX}x-3f"));
        for d in [&dead_dir, &live_dir, &other] {
            std::fs::create_dir_all(d.join("inner")).unwrap();
        }
        sweep_budget_dirs(&tmp);
        let (dead_gone, live_kept, other_kept) = (!dead_dir.exists(), live_dir.exists(), other.exists());
        std::fs::remove_dir_all(&tmp).unwrap();
        assert!(dead_gone, "a dead process's directory was kept");
        assert!(live_kept && other_kept, "a live or unparsable directory was removed");
    }
}
