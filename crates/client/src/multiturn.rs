//! The multi-turn load scenario: several tenants, each with its own system prompt shared by
//! all of its conversations, chat with the server concurrently, turn after turn. Each turn
//! resends the whole conversation — the system prompt, every earlier user message and
//! answer, and a new short user message — so a server with a prefix cache can reuse the
//! conversation's earlier turns and the tenant's system prompt, and TTFT of later turns
//! shows it. The server's own count of reused tokens
//! (`usage.prompt_tokens_details.cached_tokens`) is summed beside the prompt tokens.
//!
//! Prompts, user messages and `max_tokens` come from the seed, so two runs with one seed
//! send the same first turns (later turns carry the server's answers, which may differ).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::ClientError;
use crate::dist::{Dist, Rng, code, words};
use crate::openai::{Api, Client, HangUp, Outcome};
use crate::report::{Tallier, Tally, classify, ms};
use crate::stats::percentile;

/// Words in each new user message (about one token each).
pub const USER_WORDS: usize = 24;
/// Error messages kept per report (the counts cover all).
const ERROR_EXAMPLES: usize = 5;
/// Separates the random streams of system prompts and of turns drawn from one seed.
const SYSTEM_STREAM: u64 = 0x5359_5354_454D_0001;
const TURN_STREAM: u64 = 0x5455_524E_0000_0002;

/// What to send and how much.
#[derive(Debug, Clone)]
pub struct MultiTurnConfig {
    /// The `model` field.
    pub model: String,
    /// Tenants; each has its own client, system prompt and conversations.
    pub tenants: usize,
    /// Conversations per tenant.
    pub conversations: usize,
    /// User turns per conversation.
    pub turns: usize,
    /// Words in each tenant's system prompt (about one token each).
    pub system_prompt_words: usize,
    /// `max_tokens` of each turn.
    pub output_tokens: Dist,
    /// Conversations in progress at once (default: all of them).
    pub concurrency: Option<usize>,
    /// Seed of system prompts, user messages and lengths.
    pub seed: u64,
    /// Send `ignore_eos: true`, so each answer is exactly `max_tokens` long.
    pub ignore_eos: bool,
    /// Stream (needed for TTFT and inter-token latency; asks for usage in the last chunk).
    pub stream: bool,
    /// Sampling temperature.
    pub temperature: f32,
}

impl MultiTurnConfig {
    /// All conversations of all tenants.
    pub fn total_conversations(&self) -> usize {
        self.tenants * self.conversations
    }

    /// Conversations in progress at once: the cap, else all of them.
    pub fn effective_concurrency(&self) -> usize {
        self.concurrency.unwrap_or(self.total_conversations()).clamp(1, self.total_conversations().max(1))
    }

    /// Tenant `tenant`'s system prompt: the same for all its conversations, different (from
    /// its first words on) for every other tenant.
    pub fn system_prompt(&self, tenant: usize) -> String {
        let mut rng = Rng::for_index(self.seed ^ SYSTEM_STREAM, tenant as u64);
        let id = code(&mut rng, 12);
        format!("Tenant {tenant} session {id}. You are a helpful assistant. {}", words(&mut rng, self.system_prompt_words))
    }

    /// The new user message and `max_tokens` of turn `turn` (from 0) of conversation
    /// `conversation` of tenant `tenant`.
    pub fn user_turn(&self, tenant: usize, conversation: usize, turn: usize) -> (String, u32) {
        let index = ((tenant * self.conversations + conversation) * self.turns + turn) as u64;
        let mut rng = Rng::for_index(self.seed ^ TURN_STREAM, index);
        let max_tokens = self.output_tokens.sample(&mut rng);
        (words(&mut rng, USER_WORDS), max_tokens)
    }
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The tenant's system prompt.
    System,
    /// The user.
    User,
    /// The server's answer.
    Assistant,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// Its text.
    pub content: String,
}

/// One conversation: its messages so far, ending with the user message to answer next.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// Its tenant.
    pub tenant: usize,
    /// Its number within the tenant.
    pub index: usize,
    /// User turns so far (the last one not yet answered).
    pub turn: usize,
    /// `max_tokens` of the pending turn.
    pub max_tokens: u32,
    /// The messages, from the system prompt on.
    pub messages: Vec<Message>,
}

impl Conversation {
    /// The start of conversation `index` of `tenant`: its system prompt and first user
    /// message.
    pub fn start(cfg: &MultiTurnConfig, tenant: usize, index: usize, system_prompt: String) -> Conversation {
        let (user, max_tokens) = cfg.user_turn(tenant, index, 0);
        Conversation {
            tenant,
            index,
            turn: 1,
            max_tokens,
            messages: vec![Message { role: Role::System, content: system_prompt }, Message { role: Role::User, content: user }],
        }
    }

    /// Record the answer to the pending turn; then, unless that was the last turn, add the
    /// next user message. Returns whether a turn is pending.
    pub fn answer(&mut self, cfg: &MultiTurnConfig, text: String) -> bool {
        self.messages.push(Message { role: Role::Assistant, content: text });
        if self.turn >= cfg.turns {
            return false;
        }
        let (user, max_tokens) = cfg.user_turn(self.tenant, self.index, self.turn);
        self.messages.push(Message { role: Role::User, content: user });
        self.turn += 1;
        self.max_tokens = max_tokens;
        true
    }

    /// The `/v1/chat/completions` body of the pending turn.
    pub fn body(&self, cfg: &MultiTurnConfig) -> Value {
        let mut b = json!({
            "model": cfg.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": cfg.temperature,
        });
        if cfg.ignore_eos {
            b["ignore_eos"] = json!(true);
        }
        if cfg.stream {
            b["stream"] = json!(true);
            b["stream_options"] = json!({ "include_usage": true });
        }
        b
    }
}

/// One finished turn.
#[derive(Debug)]
struct Turn {
    /// 1 for the first user turn.
    turn: usize,
    /// The answer, or the kind and message of its failure ([`classify`]).
    result: Result<Outcome, (String, String)>,
    max_tokens: u32,
    /// A later turn's prompt tokens past the previous turn's prompt and answer (what is
    /// new in it, if the answer tokenizes back as it was generated), from `usage`.
    new_tokens: Option<u64>,
}

/// TTFT of one turn number over all conversations.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TurnTtft {
    /// Turn (1 = the first user message).
    pub turn: usize,
    /// Answers timed.
    pub n: usize,
    /// Median TTFT (ms).
    pub p50_ms: f64,
}

/// The result of a multi-turn run.
#[derive(Debug, Clone, Serialize)]
pub struct MultiTurnReport {
    /// Server.
    pub url: String,
    /// Always chat: the scenario needs a message list.
    pub api: Api,
    /// Model asked for.
    pub model: String,
    /// Tenants.
    pub tenants: usize,
    /// Conversations per tenant.
    pub conversations_per_tenant: usize,
    /// User turns per conversation.
    pub turns: usize,
    /// Words of each tenant's system prompt.
    pub system_prompt_words: usize,
    /// Words of each user message.
    pub user_words: usize,
    /// `max_tokens` distribution.
    pub max_tokens: Dist,
    /// Conversations in progress at once.
    pub concurrency: usize,
    /// Seed.
    pub seed: u64,
    /// Streamed.
    pub stream: bool,
    /// `ignore_eos` sent.
    pub ignore_eos: bool,
    /// Requests sent: `tally.ok + tally.failed` (a failure ends its conversation).
    pub requests: u64,
    /// Turns not sent because their conversation had failed.
    pub skipped_turns: u64,
    /// What the requests did, all turns together, over the run's wall time.
    #[serde(flatten)]
    pub tally: Tally,
    /// Median TTFT of each turn number.
    pub ttft_by_turn: Vec<TurnTtft>,
    /// Median TTFT of first turns (ms).
    pub ttft_first_turn_p50_ms: Option<f64>,
    /// Median TTFT of all later turns together (ms).
    pub ttft_later_turns_p50_ms: Option<f64>,
    /// Of the responses with usage (the tally's `responses_with_usage`), the ones with
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub responses_with_cached_tokens: u64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens` (absent counts as 0).
    pub cached_tokens: u64,
    /// Sum of first turns' `usage.prompt_tokens`.
    pub first_turn_prompt_tokens: u64,
    /// Sum over later turns of their prompt tokens past the previous turn's prompt and
    /// answer: what is new in them (exact when the answer tokenizes back as generated).
    pub later_turn_new_tokens: u64,
    /// `cached_tokens / prompt_tokens` (the tally's sum of `usage.prompt_tokens`), when any
    /// prompt tokens were reported.
    pub cached_share: Option<f64>,
}

/// Run the scenario: `clients[i]` is tenant `i` (its API key and headers).
pub async fn run(clients: &[Client], cfg: &MultiTurnConfig) -> Result<MultiTurnReport, ClientError> {
    if cfg.tenants == 0 || cfg.conversations == 0 || cfg.turns == 0 {
        return Err(ClientError::Config("tenants, conversations and turns must each be at least 1".into()));
    }
    if clients.len() != cfg.tenants {
        return Err(ClientError::Config(format!("{} tenants but {} clients", cfg.tenants, clients.len())));
    }
    if cfg.concurrency == Some(0) {
        return Err(ClientError::Config("concurrency must be at least 1".into()));
    }
    let permits = Arc::new(Semaphore::new(cfg.effective_concurrency()));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (tenant, client) in clients.iter().enumerate() {
        let system = cfg.system_prompt(tenant);
        for index in 0..cfg.conversations {
            let (client, cfg, permits) = (client.clone(), cfg.clone(), permits.clone());
            let mut conv = Conversation::start(&cfg, tenant, index, system.clone());
            tasks.spawn(async move {
                // The semaphore is never closed, so acquiring cannot fail.
                let _permit = permits.acquire_owned().await.ok();
                let mut turns = Vec::with_capacity(cfg.turns);
                let mut before: Option<u64> = None;
                loop {
                    let r = client.complete_body(Api::Chat, &conv.body(&cfg), HangUp::Never).await;
                    let result = classify(r, cfg.stream);
                    let text = result.as_ref().ok().map(|o| o.text.clone());
                    let usage = result.as_ref().ok().and_then(|o| o.usage.map(|u| (u.prompt_tokens, o.output_tokens())));
                    let new_tokens = before.zip(usage).map(|(b, (prompt, _))| prompt.saturating_sub(b));
                    before = usage.map(|(prompt, output)| prompt + output);
                    turns.push(Turn { turn: conv.turn, result, max_tokens: conv.max_tokens, new_tokens });
                    // A failed turn has no answer to build on: the conversation ends.
                    let Some(text) = text else { break };
                    if !conv.answer(&cfg, text) {
                        break;
                    }
                }
                turns
            });
        }
    }
    let mut turns = Vec::new();
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(t) => turns.extend(t),
            Err(e) => return Err(ClientError::Config(format!("a conversation task failed: {e}"))),
        }
    }
    Ok(report(clients, cfg, &turns, start.elapsed()))
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

fn report(clients: &[Client], cfg: &MultiTurnConfig, turns: &[Turn], elapsed: Duration) -> MultiTurnReport {
    let mut tally = Tallier::new(ERROR_EXAMPLES);
    let mut by_turn: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let (mut with_cached, mut cached_tokens, mut first_turn_prompt_tokens, mut later_turn_new_tokens) = (0u64, 0u64, 0u64, 0u64);
    for t in turns {
        tally.add_outcome(&t.result, t.max_tokens);
        later_turn_new_tokens += t.new_tokens.unwrap_or(0);
        let Ok(o) = &t.result else { continue };
        if let Some(u) = o.usage {
            if t.turn == 1 {
                first_turn_prompt_tokens += u.prompt_tokens;
            }
            with_cached += u64::from(u.cached_tokens.is_some());
            cached_tokens += u.cached_tokens.unwrap_or(0);
        }
        if let Some(x) = o.ttft.map(ms) {
            by_turn.entry(t.turn).or_default().push(x);
        }
    }
    let tally = tally.finish(elapsed, &[]);
    let first = by_turn.get(&1).cloned().unwrap_or_default();
    let later: Vec<f64> = by_turn.iter().filter(|(t, _)| **t > 1).flat_map(|(_, v)| v.iter().copied()).collect();
    let ttft_by_turn = by_turn.iter().filter_map(|(&turn, v)| Some(TurnTtft { turn, n: v.len(), p50_ms: median(v.clone())? })).collect();
    let planned = (cfg.total_conversations() * cfg.turns) as u64;
    MultiTurnReport {
        url: clients.first().map(|c| c.config().url.to_string()).unwrap_or_default(),
        api: Api::Chat,
        model: cfg.model.clone(),
        tenants: cfg.tenants,
        conversations_per_tenant: cfg.conversations,
        turns: cfg.turns,
        system_prompt_words: cfg.system_prompt_words,
        user_words: USER_WORDS,
        max_tokens: cfg.output_tokens,
        concurrency: cfg.effective_concurrency(),
        seed: cfg.seed,
        stream: cfg.stream,
        ignore_eos: cfg.ignore_eos,
        requests: tally.requests(),
        skipped_turns: planned.saturating_sub(tally.requests()),
        ttft_by_turn,
        ttft_first_turn_p50_ms: median(first),
        ttft_later_turns_p50_ms: median(later),
        responses_with_cached_tokens: with_cached,
        cached_tokens,
        first_turn_prompt_tokens,
        later_turn_new_tokens,
        cached_share: (tally.prompt_tokens > 0).then(|| cached_tokens as f64 / tally.prompt_tokens as f64),
        tally,
    }
}

impl std::fmt::Display for MultiTurnReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "loadgen multi-turn: {} /v1/chat/completions (model {}), {} tenants x {} conversations x {} turns, {} conversations at once",
            self.url, self.model, self.tenants, self.conversations_per_tenant, self.turns, self.concurrency
        )?;
        writeln!(
            f,
            "  system prompt {} words per tenant, user messages {} words, max_tokens {}{}, seed {}",
            self.system_prompt_words,
            self.user_words,
            self.max_tokens,
            if self.ignore_eos { " (ignore_eos)" } else { "" },
            self.seed
        )?;
        self.tally.write_summary(f, &format!(", {} turns skipped", self.skipped_turns))?;
        if !self.ttft_by_turn.is_empty() {
            let turns: Vec<String> = self.ttft_by_turn.iter().map(|t| format!("{}: {:.2}", t.turn, t.p50_ms)).collect();
            writeln!(f, "  TTFT p50 by turn (ms)  {}", turns.join("  "))?;
        }
        if let (Some(a), Some(b)) = (self.ttft_first_turn_p50_ms, self.ttft_later_turns_p50_ms) {
            writeln!(f, "  TTFT p50      turn 1 {a:.2} ms, later turns {b:.2} ms")?;
        }
        match self.cached_share {
            Some(share) => writeln!(
                f,
                "  prompt cache  {} of {} prompt tokens cached ({:.1}%; {} of {} responses with usage reported cached_tokens)",
                self.cached_tokens,
                self.tally.prompt_tokens,
                share * 100.0,
                self.responses_with_cached_tokens,
                self.tally.responses_with_usage
            )?,
            None => writeln!(f, "  prompt cache  - (the server reported no prompt tokens)")?,
        }
        self.tally.failures.write(f, "  ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MultiTurnConfig {
        MultiTurnConfig {
            model: "m".into(),
            tenants: 2,
            conversations: 3,
            turns: 3,
            system_prompt_words: 50,
            output_tokens: "uniform:4:8".parse().unwrap_or(Dist::Fixed { value: 4 }),
            concurrency: None,
            seed: 9,
            ignore_eos: true,
            stream: true,
            temperature: 0.0,
        }
    }

    #[test]
    fn a_tenant_shares_its_system_prompt_and_tenants_differ_from_the_start() {
        let c = cfg();
        let (a, b) = (c.system_prompt(0), c.system_prompt(1));
        assert_eq!(a, c.system_prompt(0));
        assert_ne!(a, b);
        assert!(a.split(' ').count() >= 50, "{a}");
        // They differ from their second word (the tenant) on, and in the random session code.
        assert_ne!(a.split(' ').nth(1), b.split(' ').nth(1));
        assert_ne!(a.split(' ').nth(3), b.split(' ').nth(3));
        let x = Conversation::start(&c, 0, 0, a.clone());
        let y = Conversation::start(&c, 0, 1, a.clone());
        assert_eq!(x.messages[0], y.messages[0]);
        assert_ne!(x.messages[1], y.messages[1], "conversations ask different things");
    }

    #[test]
    fn each_turn_appends_the_answer_and_a_new_user_message() {
        let c = cfg();
        let mut conv = Conversation::start(&c, 1, 2, c.system_prompt(1));
        assert_eq!((conv.turn, conv.messages.len()), (1, 2));
        assert!(conv.answer(&c, "first answer".into()));
        assert_eq!((conv.turn, conv.messages.len()), (2, 4));
        assert!(conv.answer(&c, "second answer".into()));
        let body = conv.body(&c);
        let roles: Vec<&str> = body["messages"].as_array().into_iter().flatten().filter_map(|m| m["role"].as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user", "assistant", "user"]);
        assert_eq!(body["messages"][2]["content"], "first answer");
        assert_eq!(body["messages"][4]["content"], "second answer");
        assert_eq!(body["messages"][5]["content"].as_str().map(|s| s.split(' ').count()), Some(USER_WORDS));
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["ignore_eos"], true);
        assert!((4..=8).contains(&conv.max_tokens));
        assert_eq!(body["max_tokens"], conv.max_tokens);
        // The third turn was the last: answering it adds no user message.
        assert!(!conv.answer(&c, "third answer".into()));
        assert_eq!((conv.turn, conv.messages.len()), (3, 7));
        // The same seed gives the same user messages.
        assert_eq!(c.user_turn(1, 2, 1), c.user_turn(1, 2, 1));
        assert_ne!(c.user_turn(1, 2, 1), c.user_turn(1, 2, 2));
    }

    #[test]
    fn concurrency_defaults_to_every_conversation_and_a_cap_limits_it() {
        let mut c = cfg();
        assert_eq!(c.effective_concurrency(), 6);
        c.concurrency = Some(4);
        assert_eq!(c.effective_concurrency(), 4);
        c.concurrency = Some(100);
        assert_eq!(c.effective_concurrency(), 6);
    }
}
