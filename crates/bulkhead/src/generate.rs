//! `bulkhead generate`: apply the chat template (a base model continues the prompt as
//! raw text), stream the reply to stdout.

use std::io::Write;
use std::sync::Arc;

use anyhow::Context;
use bulkhead_engine::{Engine, EngineConfig, Event, GenRequest, Sampling};
use bulkhead_kv::{KvChecks, KvPool, PoolConfig};
use bulkhead_protocol::admission::{Generate, admit};
use bulkhead_tokenizer::ChatMessage;
use clap::Args;

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message.
    #[arg(long, env = "BULKHEAD_GENERATE_PROMPT")]
    prompt: String,
    /// A system message (else the chat template's default, if it has one).
    #[arg(long, env = "BULKHEAD_GENERATE_SYSTEM")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, env = "BULKHEAD_GENERATE_MAX_TOKENS", default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, env = "BULKHEAD_GENERATE_TEMPERATURE", default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, env = "BULKHEAD_GENERATE_TOP_P", default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, env = "BULKHEAD_GENERATE_TOP_K", default_value_t = 0)]
    top_k: u32,
    /// Seed for reproducible sampling.
    #[arg(long, env = "BULKHEAD_GENERATE_SEED")]
    seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long, env = "BULKHEAD_GENERATE_STOP")]
    stop: Vec<String>,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let m = a.model.load()?;
    let mut prompt = match &m.chat {
        Some(chat) => {
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(ChatMessage::new("system", s.clone()));
            }
            messages.push(ChatMessage::new("user", a.prompt.clone()));
            m.tokenizer.encode(&chat.render(&messages, true).context("chat template")?, true)
        }
        // A base model continues the text itself.
        None => {
            anyhow::ensure!(
                a.system.is_none(),
                "this model has no chat template (a base model), so --system has no place; pass --chat-template FILE"
            );
            eprintln!("bulkhead: the model has no chat template (a base model): continuing --prompt as raw text");
            m.tokenizer.encode(&a.prompt, false)
        }
    };
    if let Some(bos) = m.tokenizer.bos_id().filter(|_| m.tokenizer.add_bos())
        && prompt.first() != Some(&bos)
    {
        prompt.insert(0, bos);
    }
    let context = m.model.config.context_length;
    let needed = admit(prompt.len(), Generate::Tokens(a.max_tokens), context).context("--prompt with --max-tokens")?;
    let layout = m.model.kv_layout(a.model.page_size as usize);
    let pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(needed), checks: KvChecks::default() })?;
    let sampling = Sampling { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed, ..Sampling::default() };
    let mut engine = Engine::new(Arc::new(m.model), Arc::new(m.tokenizer), pool, EngineConfig::for_context(context));
    engine.add(GenRequest { prompt, max_tokens: a.max_tokens, sampling, stop: a.stop })?;
    let mut out = std::io::stdout().lock();
    while engine.active() > 0 {
        for ev in engine.step()? {
            match ev {
                Event::Token { text, .. } => out.write_all(text.as_bytes())?,
                Event::Finished { text, finish, prompt_tokens, completion_tokens, .. } => {
                    out.write_all(text.as_bytes())?;
                    writeln!(out)?;
                    tracing::info!(reason = finish.as_str(), prompt_tokens, completion_tokens, "finished");
                }
                Event::Failed { detail, .. } => anyhow::bail!("generation failed: {detail}"),
                // Only sequences verified from a prefill worker leave the engine retracted.
                Event::Retracted { .. } => anyhow::bail!("the engine retracted the request"),
            }
            out.flush()?;
        }
    }
    Ok(())
}
