//! `bulkhead serve`: the gateway, prefill and decode roles. With no `--role`, all three on
//! this machine: the gateway in this process, each worker a child process of this binary
//! talking to it over loopback TCP, given its settings as data on its standard input.
//! Children exit when their gateway connection closes, so they never outlive this process.
//! Parsing only, and wiring: the settings are [`args`], the roles are
//! `bulkhead_gateway` and `bulkhead_worker`, the children's supervisor is
//! `bulkhead_gateway::supervisor`.

pub mod args;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use bulkhead_gateway::supervisor::{BudgetDir, Supervisor};
use bulkhead_transport::kv_transport::KvTransport;
use bulkhead_transport::trust::Trust;
use bulkhead_worker::worker::WorkerError;

pub use args::ServeArgs;
use args::{ServeRole, prefix_cache_described};
pub use bulkhead_gateway::supervisor::EXIT_CANNOT_START;

/// Why a process cannot start, when a restart would fail the same way: `main` exits with
/// [`EXIT_CANNOT_START`], and the `serve` that started it gives up at once naming it.
#[derive(Debug)]
pub struct CannotStart(anyhow::Error);

impl std::fmt::Display for CannotStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for CannotStart {}

fn cannot_start(e: impl Into<anyhow::Error>) -> anyhow::Error {
    anyhow::Error::new(CannotStart(e.into()))
}

/// A child's settings: one line of JSON on standard input, before the cluster key's.
fn read_settings() -> anyhow::Result<ServeArgs> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).context("cannot read the settings from standard input")?;
    serde_json::from_str(&line).context("the settings on standard input")
}

/// The checks of `a` that need no model loaded, and the model's path and the cluster key.
fn settle(a: &ServeArgs) -> anyhow::Result<(PathBuf, Trust)> {
    a.check_core_budget()?;
    a.check_gateways()?;
    a.check_speculation()?;
    let model = a.model.path()?;
    let trust = a.trust()?;
    if a.role != ServeRole::Gateway {
        KvTransport::from(a.kv_transport).check(&trust).map_err(anyhow::Error::msg)?;
    }
    if a.health_listen.is_some() && !matches!(a.role, ServeRole::Prefill | ServeRole::Decode) {
        anyhow::bail!(
            "--health-listen is for prefill and decode workers (--role prefill or decode); the gateway answers /health and /ready on its HTTP port"
        );
    }
    Ok((model, trust))
}

/// Run `serve` as `a` says (or, for a child of `serve --role all`, as the settings on its
/// standard input say).
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let a = if a.settings_stdin { read_settings().map_err(cannot_start)? } else { a };
    let (model, trust) = settle(&a).map_err(cannot_start)?;
    if a.exit_with_stdin {
        // After the key (if any) was read from it: `serve` holds the other end.
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            tracing::warn!("standard input closed: the serve that started this gateway is gone; exiting");
            std::process::exit(0);
        });
    }
    match a.role {
        ServeRole::Prefill | ServeRole::Decode => {
            if a.gateway.is_empty() {
                return Err(cannot_start(anyhow::anyhow!("--gateway HOST:PORT is required for a worker role")));
            }
            let gw = a.gateway.clone();
            // Bound before the model loads, so probes see a worker that is starting.
            let health = match &a.health_listen {
                Some(addr) => {
                    let l = std::net::TcpListener::bind(addr)
                        .with_context(|| format!("cannot listen for health probes on {addr} (--health-listen)"))?;
                    tracing::info!(addr = %l.local_addr()?, "health probes: GET /health, GET /ready");
                    let h = bulkhead_worker::health::Health::new();
                    bulkhead_worker::health::spawn(l, h.clone());
                    Some(h)
                }
                None => None,
            };
            let mut cfg = a.worker(model, gw, trust).map_err(cannot_start)?;
            cfg.health = health;
            let ran = if a.role == ServeRole::Prefill { bulkhead_worker::prefill::run(cfg) } else { bulkhead_worker::decode::run(cfg) };
            ran.map_err(|e| if matches!(e, WorkerError::CannotStart(_)) { cannot_start(e) } else { e.into() })
        }
        ServeRole::Gateway | ServeRole::All => {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(serve_gateway(a, model, trust))
        }
    }
}

async fn serve_gateway(a: ServeArgs, model: PathBuf, trust: Trust) -> anyhow::Result<()> {
    let secret = trust.key.as_ref().map(|k| k.to_hex());
    let tenants = a.tenants()?;
    let access =
        if tenants.authenticates() { format!("{} tenant(s), API keys required", tenants.len()) } else { "open (no API key)".into() };
    let cache = prefix_cache_described(a.no_prefix_cache, a.prefix_cache_pages);
    let opts = a.gateway_options(model.clone(), trust, tenants)?;
    let mut gw = bulkhead_gateway::start(opts).await.with_context(|| format!("cannot start the gateway on {}:{}", a.host, a.port))?;
    // Declared before the workers, so it is removed after they are stopped.
    let budget = if a.role == ServeRole::All && a.budget_mode().is_some() { Some(BudgetDir::new()?) } else { None };
    let mut children = Supervisor::default();
    let mut banner = format!("bulkhead: serving on http://{} (workers register at {})", gw.http_addr, gw.worker_addr);
    if a.role == ServeRole::All {
        let exe = std::env::current_exe()?;
        let mut gw_addrs = vec![gw.worker_addr.to_string()];
        for i in 1..a.gateways {
            let (http, at) = start_gateway(&mut children, &a, &exe, &model, i, secret.as_deref())
                .with_context(|| format!("cannot start gateway {i}"))?;
            banner.push_str(&format!(", gateway {i} on http://{http} (workers register at {at})"));
            gw_addrs.push(at);
        }
        for (role, n) in [(ServeRole::Prefill, a.prefill_workers), (ServeRole::Decode, a.decode_workers)] {
            let settings =
                a.worker_settings(role, model.clone(), gw_addrs.clone(), budget.as_ref().map(|b| b.path().to_path_buf()), secret.is_some());
            for _ in 0..n {
                let name = if role == ServeRole::Prefill { "prefill" } else { "decode" };
                children
                    .add(name.to_string(), child_command(&exe, name), child_input(&settings, secret.as_deref())?)
                    .with_context(|| format!("cannot start a {name} worker"))?;
            }
        }
    }
    tracing::info!(%access, prefix_cache = %cache.as_deref().unwrap_or("off"), "serving");
    println!("{banner}");
    let outcome = tokio::select! {
        () = shutdown_signal() => Ok(()),
        e = children.supervise() => Err(e),
    };
    if outcome.is_err() {
        // Nothing here can bring the workers back: say so to probes, and keep saying it for
        // a while before exiting, so that a supervisor polling /health sees the 503.
        gw.mark_failed();
        tracing::error!(seconds = FAILED_HEALTH_LINGER.as_secs(), "answering /health with 503 before exiting");
        tokio::select! {
            () = shutdown_signal() => {}
            () = tokio::time::sleep(FAILED_HEALTH_LINGER) => {}
        }
    }
    tracing::info!("shutting down: draining in-flight requests");
    gw.shutdown();
    if tokio::time::timeout(Duration::from_secs(a.drain_timeout_s), &mut gw.server).await.is_err() {
        tracing::warn!(drain_timeout_s = a.drain_timeout_s, "drain timed out; exiting with requests in flight");
    }
    Ok(outcome?)
}

/// How long a gateway child may take to print its addresses.
const GATEWAY_START_TIMEOUT: Duration = Duration::from_secs(60);

/// Start gateway `i` beside this process's own: the same gateway settings under its own
/// id, on the next HTTP port (or any free one with `--port 0`) and any free worker port,
/// both kept when it is restarted. Returns its HTTP and worker addresses, read from the
/// line it prints.
fn start_gateway(
    children: &mut Supervisor,
    a: &ServeArgs,
    exe: &Path,
    model: &Path,
    i: u8,
    secret: Option<&str>,
) -> anyhow::Result<(String, String)> {
    let port = if a.port == 0 { 0 } else { a.port.checked_add(u16::from(i)).context("no HTTP port left above --port")? };
    let host = a.worker_listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
    let settings = a.gateway_settings(i, port, format!("{host}:0"), model.to_path_buf(), secret.is_some());
    let (slot, line) = children.add_announcing(
        format!("gateway-{i}"),
        child_command(exe, &format!("gateway-{i}")),
        child_input(&settings, secret)?,
        GATEWAY_START_TIMEOUT,
    )?;
    let http = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_string);
    let at = line.split("register at ").nth(1).and_then(|r| r.split(')').next()).map(str::to_string);
    let (Some(http), Some(at)) = (http, at) else { anyhow::bail!("unexpected first line {line:?}") };
    let http_port = http.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or(port);
    children.set_input(slot, child_input(&a.gateway_settings(i, http_port, at.clone(), model.to_path_buf(), secret.is_some()), secret)?);
    tracing::info!(gateway = i, %http, workers = %at, pid = children.pid(slot).unwrap_or(0), "gateway started");
    Ok((http, at))
}

/// A child of this `serve`: this binary, its settings on standard input, named
/// `bulkhead-NAME` in its argv[0] (what `ps` and the soak see: the settings are not on its
/// command line). None of this process's `BULKHEAD_*` environment (a config file, keys) is
/// the child's, but for the log filter and the kernel overrides (`BULKHEAD_NO_VNNI`,
/// `BULKHEAD_FORCE_SCALAR`), which are the machine's, not settings: without them an AVX2
/// benchmark of `serve` ran the workers on VNNI kernels.
fn child_command(exe: &Path, name: &str) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(exe);
    cmd.arg0(format!("bulkhead-{name}"));
    cmd.args(["serve", "--settings-stdin"]);
    for (k, _) in std::env::vars_os() {
        const KEPT: [&str; 3] = ["BULKHEAD_LOG", "BULKHEAD_NO_VNNI", "BULKHEAD_FORCE_SCALAR"];
        if k.to_str().is_some_and(|k| k.starts_with("BULKHEAD_") && !KEPT.contains(&k)) {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// What a child reads on standard input: its settings as one JSON line, then the cluster
/// key's line (if any).
fn child_input(settings: &ServeArgs, secret: Option<&str>) -> anyhow::Result<String> {
    let mut input = serde_json::to_string(settings)?;
    input.push('\n');
    if let Some(s) = secret {
        input.push_str(s);
        input.push('\n');
    }
    Ok(input)
}

/// How long `serve` keeps answering `/health` with 503 after a worker crash-looped, before it
/// exits non-zero (a signal cuts it short).
const FAILED_HEALTH_LINGER: Duration = Duration::from_secs(5);

/// Wait for SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
