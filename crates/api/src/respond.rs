//! Answers to completion requests. One request may start several generations (a batch of
//! prompts, `n` choices each, or `best_of` of which the most likely `n` are kept); they are
//! merged here into one JSON response or one event stream, each choice under its `index`,
//! with tool calls parsed out of the text and log-probabilities named by their tokens.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bulkhead_protocol::TokenLogprobs;
use futures_util::stream::{self, SelectAll, Stream, StreamExt};
use serde::Serialize;
use tokio::sync::mpsc::Receiver;
use tracing::{Instrument, Span};

use crate::backend::{FinishReason, GenEvent};
use crate::error::ApiError;
use crate::openai::{
    AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatLogprobs, ChunkChoice, Delta, FunctionCall, TextChoice, TextCompletion,
    TextLogprobs, TokenLogprob, ToolCallDelta, ToolCallObject, TopLogprob, Usage,
};
use crate::prompt::PromptEncoder;
use crate::tools::{self, CallParser, Piece, ToolCall};

/// Which completion endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Text,
}

/// What every response object of one request shares, and how its choices are shaped.
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    pub include_usage: bool,
    /// Choices returned per prompt.
    pub n: usize,
    /// Chat with tools: parse calls out of the text (and whether several may come).
    pub parse_calls: Option<bool>,
    /// Whether the client asked for log-probabilities (`best_of` asks for them itself).
    pub logprobs: bool,
    /// Text completions with `echo`: each prompt's text, which starts its choices.
    pub echo: Vec<String>,
}

/// One generation: the prompt it continues and its events.
pub(crate) struct Generation {
    pub prompt: usize,
    pub rx: Receiver<GenEvent>,
    /// An event already taken from `rx`, delivered first.
    pub first: Option<GenEvent>,
}

impl Generation {
    async fn next(&mut self) -> Option<GenEvent> {
        match self.first.take() {
            Some(e) => Some(e),
            None => self.rx.recv().await,
        }
    }
}

/// A finished generation.
struct Done {
    prompt: usize,
    text: String,
    logprobs: Vec<(u32, TokenLogprobs)>,
    reason: FinishReason,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
}

impl Done {
    fn score(&self) -> f64 {
        self.logprobs.iter().map(|(_, l)| f64::from(l.logprob)).sum()
    }
}

async fn collect_one(mut g: Generation) -> Result<Done, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    loop {
        match g.next().await {
            Some(GenEvent::Text { text: t, logprobs: l }) => {
                text.push_str(&t);
                logprobs.extend(l);
            }
            Some(GenEvent::Finished { reason, prompt_tokens, completion_tokens, cached_tokens }) => {
                return Ok(Done { prompt: g.prompt, text, logprobs, reason, prompt_tokens, completion_tokens, cached_tokens });
            }
            Some(GenEvent::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("The generation ended without a result.")),
        }
    }
}

/// Usage over all generations: each prompt's tokens once (from its first generation, as if
/// the prompt were computed once), every generated token.
fn usage(firsts: impl Iterator<Item = (usize, usize)>, completion_tokens: usize) -> Usage {
    let (prompt, cached) = firsts.fold((0, 0), |(p, c), (fp, fc)| (p + fp, c + fc));
    Usage::new(prompt, completion_tokens, cached)
}

fn top_pieces(encoder: &PromptEncoder, l: &TokenLogprobs) -> Vec<TopLogprob> {
    l.top
        .iter()
        .map(|&(id, logprob)| {
            let (token, bytes) = encoder.token_piece(id);
            TopLogprob { token, logprob, bytes }
        })
        .collect()
}

fn chat_logprob(encoder: &PromptEncoder, id: u32, l: &TokenLogprobs) -> TokenLogprob {
    let (token, bytes) = encoder.token_piece(id);
    TokenLogprob { token, logprob: l.logprob, bytes, top_logprobs: top_pieces(encoder, l) }
}

/// Adds one token to legacy text log-probabilities; `offset` is where its text starts.
fn push_text_logprob(out: &mut TextLogprobs, encoder: &PromptEncoder, id: u32, l: &TokenLogprobs, offset: usize) {
    out.tokens.push(encoder.token_piece(id).0);
    out.token_logprobs.push(l.logprob);
    out.top_logprobs.push(top_pieces(encoder, l).into_iter().map(|t| (t.token, t.logprob)).collect::<BTreeMap<_, _>>());
    out.text_offset.push(offset);
}

fn tool_objects(calls: Vec<ToolCall>) -> Vec<ToolCallObject> {
    calls
        .into_iter()
        .map(|c| ToolCallObject { id: c.id, kind: "function", function: FunctionCall { name: c.name, arguments: c.arguments } })
        .collect()
}

/// `finish_reason` of a choice: `tool_calls` when it ended by itself after calling tools.
fn finish_str(reason: FinishReason, calls: usize) -> &'static str {
    if calls > 0 && reason == FinishReason::Stop { "tool_calls" } else { reason.as_str() }
}

fn call_prefix(meta: &Meta, index: u32) -> String {
    format!("call_{}_{index}_", &meta.id[meta.id.len().saturating_sub(12)..])
}

/// The whole answer, once every generation finished; the first failure is the answer.
pub(crate) async fn collect_response(meta: Meta, encoder: &PromptEncoder, gens: Vec<Generation>) -> Result<Response, ApiError> {
    let mut done = Vec::with_capacity(gens.len());
    for g in gens {
        done.push(collect_one(g).await?);
    }
    let completion_tokens = done.iter().map(|d| d.completion_tokens).sum();
    let prompts = done.iter().map(|d| d.prompt).max().map_or(0, |p| p + 1);
    let mut by_prompt: Vec<Vec<Done>> = (0..prompts).map(|_| Vec::new()).collect();
    for d in done {
        by_prompt[d.prompt].push(d);
    }
    let use_ = usage(by_prompt.iter().filter_map(|g| g.first()).map(|d| (d.prompt_tokens, d.cached_tokens)), completion_tokens);
    // best_of: the n most likely of each prompt's generations (a stable sort keeps the
    // order of equals).
    for g in &mut by_prompt {
        if g.len() > meta.n {
            g.sort_by(|a, b| b.score().total_cmp(&a.score()));
            g.truncate(meta.n);
        }
    }
    tracing::info!(
        prompt_tokens = use_.prompt_tokens,
        completion_tokens = use_.completion_tokens,
        choices = by_prompt.iter().map(Vec::len).sum::<usize>(),
        "completed"
    );
    let chosen = by_prompt.into_iter().flat_map(|g| g.into_iter().enumerate()).map(|(rank, d)| ((d.prompt * meta.n + rank) as u32, d));
    Ok(match meta.endpoint {
        Endpoint::Chat => {
            let choices = chosen
                .map(|(index, d)| {
                    let (content, calls) = match meta.parse_calls {
                        Some(parallel) => tools::split(&d.text, parallel, &call_prefix(&meta, index)),
                        None => (Some(d.text), Vec::new()),
                    };
                    let logprobs = meta
                        .logprobs
                        .then(|| ChatLogprobs { content: d.logprobs.iter().map(|(id, l)| chat_logprob(encoder, *id, l)).collect() });
                    let finish_reason = finish_str(d.reason, calls.len());
                    ChatChoice {
                        index,
                        message: AssistantMessage { role: "assistant", content, tool_calls: tool_objects(calls) },
                        logprobs,
                        finish_reason,
                    }
                })
                .collect();
            Json(ChatCompletion { id: meta.id, object: "chat.completion", created: meta.created, model: meta.model, choices, usage: use_ })
                .into_response()
        }
        Endpoint::Text => {
            let choices = chosen
                .map(|(index, d)| {
                    let echo = meta.echo.get(d.prompt).map_or("", String::as_str);
                    let logprobs = meta.logprobs.then(|| {
                        let mut out = TextLogprobs::default();
                        // Offsets follow the tokens' own bytes: text held back by a stop
                        // string or a split character is attributed to the token before.
                        let mut offset = echo.len();
                        for (id, l) in &d.logprobs {
                            push_text_logprob(&mut out, encoder, *id, l, offset);
                            offset += encoder.token_piece(*id).1.len();
                        }
                        out
                    });
                    TextChoice { index, text: format!("{echo}{}", d.text), logprobs, finish_reason: Some(d.reason.as_str()) }
                })
                .collect();
            Json(TextCompletion {
                id: meta.id,
                object: "text_completion",
                created: meta.created,
                model: meta.model,
                choices,
                usage: Some(Some(use_)),
            })
            .into_response()
        }
    })
}

type Events = Pin<Box<dyn Stream<Item = (usize, GenEvent)> + Send>>;

/// A generation's events, ending after its terminal one (or with a failure if its stream
/// closes before one).
fn events(i: usize, g: Generation) -> Events {
    Box::pin(stream::unfold(Some(g), move |g| async move {
        let mut g = g?;
        let ev = g.next().await.unwrap_or_else(|| GenEvent::Failed(ApiError::internal("The generation ended without a result.")));
        let terminal = !matches!(ev, GenEvent::Text { .. });
        Some(((i, ev), (!terminal).then_some(g)))
    }))
}

/// One choice's progress in a stream.
struct Choice {
    index: u32,
    prompt: usize,
    parser: Option<CallParser>,
    /// Bytes of text sent (text completions' `text_offset`).
    sent: usize,
    finished: Option<(usize, usize, usize)>,
}

/// The state of one event stream. Dropping it (the client went away) drops every
/// generation's receiver, which tells the backend to abort them all.
struct StreamState {
    meta: Meta,
    backend: std::sync::Arc<dyn crate::Backend>,
    choices: Vec<Choice>,
    merged: SelectAll<Events>,
    started: bool,
    done: bool,
}

/// The answer as server-sent events. Every generation's first event was awaited already
/// (a refusal only a worker can make still got its HTTP status).
pub(crate) fn stream_response(meta: Meta, backend: std::sync::Arc<dyn crate::Backend>, gens: Vec<Generation>) -> Response {
    let span = Span::current();
    let choices = gens
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let index = i as u32;
            Choice {
                index,
                prompt: g.prompt,
                parser: meta.parse_calls.map(|p| CallParser::new(p, call_prefix(&meta, index))),
                sent: 0,
                finished: None,
            }
        })
        .collect();
    let merged = stream::select_all(gens.into_iter().enumerate().map(|(i, g)| events(i, g)));
    let state = StreamState { meta, backend, choices, merged, started: false, done: false };
    let body = stream::unfold(state, move |mut st| {
        async move {
            if st.done {
                return None;
            }
            let frame = st.next_frames().await;
            Some((Ok::<_, Infallible>(Bytes::from(frame)), st))
        }
        .instrument(span.clone())
    });
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(body)).into_response()
}

impl StreamState {
    /// The next SSE frame(s); sets `done` after the last.
    async fn next_frames(&mut self) -> String {
        if !self.started {
            self.started = true;
            let mut out = String::new();
            for c in &self.choices {
                match self.meta.endpoint {
                    Endpoint::Chat => out.push_str(&data(&self.chat_chunk(
                        c.index,
                        Delta { role: Some("assistant"), content: Some(String::new()), ..Delta::default() },
                        None,
                    ))),
                    Endpoint::Text => {
                        if let Some(echo) = self.meta.echo.get(c.prompt).filter(|e| !e.is_empty()) {
                            out.push_str(&data(&self.text_chunk(c.index, echo.clone(), None)));
                        }
                    }
                }
            }
            for c in &mut self.choices {
                c.sent = self.meta.echo.get(c.prompt).map_or(0, String::len);
            }
            if !out.is_empty() {
                return out;
            }
        }
        loop {
            let Some((i, ev)) = self.merged.next().await else {
                self.done = true;
                let e = ApiError::internal("The generation ended without a result.");
                tracing::warn!("{}", e.message);
                return error_end(&e);
            };
            let out = match ev {
                GenEvent::Text { text, logprobs } => self.on_text(i, text, logprobs),
                GenEvent::Finished { reason, prompt_tokens, completion_tokens, cached_tokens } => {
                    self.on_finished(i, reason, (prompt_tokens, completion_tokens, cached_tokens))
                }
                GenEvent::Failed(e) => {
                    self.done = true;
                    tracing::warn!(kind = e.error_type(), code = e.code, "generation failed mid-stream: {}", e.message);
                    return error_end(&e);
                }
            };
            if !out.is_empty() {
                return out;
            }
        }
    }

    fn on_text(&mut self, i: usize, text: String, logprobs: Option<(u32, TokenLogprobs)>) -> String {
        let logprobs = logprobs.filter(|_| self.meta.logprobs);
        let c = &mut self.choices[i];
        let index = c.index;
        match self.meta.endpoint {
            Endpoint::Chat => {
                let calls = c.parser.as_ref().map_or(0, CallParser::calls);
                let pieces = match c.parser.as_mut() {
                    Some(p) => p.push(&text),
                    None if text.is_empty() => Vec::new(),
                    None => vec![Piece::Text(text)],
                };
                let lp = logprobs.map(|(id, l)| ChatLogprobs { content: vec![chat_logprob(self.backend.encoder(), id, &l)] });
                self.chat_pieces(index, pieces, calls, lp)
            }
            Endpoint::Text => {
                if text.is_empty() && logprobs.is_none() {
                    return String::new();
                }
                let lp = logprobs.map(|(id, l)| {
                    let mut out = TextLogprobs::default();
                    push_text_logprob(&mut out, self.backend.encoder(), id, &l, c.sent);
                    out
                });
                c.sent += text.len();
                let mut chunk = self.text_chunk(index, text, None);
                chunk.choices[0].logprobs = lp;
                data(&chunk)
            }
        }
    }

    /// Chat chunks for `pieces` of choice `index`, whose calls so far numbered `calls`;
    /// `logprobs` ride on the first (an empty content chunk carries them when there is
    /// nothing else).
    fn chat_pieces(&self, index: u32, pieces: Vec<Piece>, mut calls: usize, mut logprobs: Option<ChatLogprobs>) -> String {
        let mut out = String::new();
        for p in pieces {
            let delta = match p {
                Piece::Text(t) => Delta { content: Some(t), ..Delta::default() },
                Piece::Call(c) => {
                    calls += 1;
                    Delta {
                        tool_calls: vec![ToolCallDelta {
                            index: (calls - 1) as u32,
                            id: c.id,
                            kind: "function",
                            function: FunctionCall { name: c.name, arguments: c.arguments },
                        }],
                        ..Delta::default()
                    }
                }
            };
            let mut chunk = self.chat_chunk(index, delta, None);
            chunk.choices[0].logprobs = logprobs.take();
            out.push_str(&data(&chunk));
        }
        if let Some(lp) = logprobs {
            let mut chunk = self.chat_chunk(index, Delta { content: Some(String::new()), ..Delta::default() }, None);
            chunk.choices[0].logprobs = Some(lp);
            out.push_str(&data(&chunk));
        }
        out
    }

    fn on_finished(&mut self, i: usize, reason: FinishReason, counts: (usize, usize, usize)) -> String {
        let c = &mut self.choices[i];
        c.finished = Some(counts);
        let index = c.index;
        let (before, rest, calls) = match c.parser.as_mut() {
            Some(p) => {
                let before = p.calls();
                let rest = p.finish();
                (before, rest, p.calls())
            }
            None => (0, Vec::new(), 0),
        };
        let mut out = match self.meta.endpoint {
            Endpoint::Chat => {
                let mut out = self.chat_pieces(index, rest, before, None);
                out.push_str(&data(&self.chat_chunk(index, Delta::default(), Some(finish_str(reason, calls)))));
                out
            }
            Endpoint::Text => data(&self.text_chunk(index, String::new(), Some(reason.as_str()))),
        };
        if self.choices.iter().all(|c| c.finished.is_some()) {
            self.done = true;
            let completion = self.choices.iter().filter_map(|c| c.finished).map(|f| f.1).sum();
            let n = self.meta.n;
            let u = usage(
                self.choices.iter().filter(|c| (c.index as usize).is_multiple_of(n)).filter_map(|c| c.finished).map(|f| (f.0, f.2)),
                completion,
            );
            tracing::info!(
                prompt_tokens = u.prompt_tokens,
                completion_tokens = u.completion_tokens,
                choices = self.choices.len(),
                "completed (streamed)"
            );
            if self.meta.include_usage {
                out.push_str(&match self.meta.endpoint {
                    Endpoint::Chat => data(&ChatChunk {
                        id: self.meta.id.clone(),
                        object: "chat.completion.chunk",
                        created: self.meta.created,
                        model: self.meta.model.clone(),
                        choices: Vec::new(),
                        usage: Some(Some(u)),
                    }),
                    Endpoint::Text => data(&TextCompletion {
                        id: self.meta.id.clone(),
                        object: "text_completion",
                        created: self.meta.created,
                        model: self.meta.model.clone(),
                        choices: Vec::new(),
                        usage: Some(Some(u)),
                    }),
                });
            }
            out.push_str("data: [DONE]\n\n");
        }
        out
    }

    /// A chat chunk with one choice (`usage` null when the client asked for usage: only the
    /// last chunk carries it).
    fn chat_chunk(&self, index: u32, delta: Delta, finish_reason: Option<&'static str>) -> ChatChunk {
        let m = &self.meta;
        ChatChunk {
            id: m.id.clone(),
            object: "chat.completion.chunk",
            created: m.created,
            model: m.model.clone(),
            choices: vec![ChunkChoice { index, delta, logprobs: None, finish_reason }],
            usage: m.include_usage.then_some(None),
        }
    }

    fn text_chunk(&self, index: u32, text: String, finish_reason: Option<&'static str>) -> TextCompletion {
        let m = &self.meta;
        TextCompletion {
            id: m.id.clone(),
            object: "text_completion",
            created: m.created,
            model: m.model.clone(),
            choices: vec![TextChoice { index, text, logprobs: None, finish_reason }],
            usage: m.include_usage.then_some(None),
        }
    }
}

/// The end of a stream that failed: an error body, then `[DONE]` so that clients which wait
/// for it (as the OpenAI ones do) stop reading.
fn error_end(e: &ApiError) -> String {
    data(&e.body()) + "data: [DONE]\n\n"
}

/// One SSE `data:` frame. JSON never contains a raw newline, so one line suffices.
fn data<T: Serialize>(v: &T) -> String {
    match serde_json::to_string(v) {
        Ok(s) => format!("data: {s}\n\n"),
        Err(e) => {
            let body = ApiError::internal(format!("cannot encode a stream chunk: {e}")).body();
            format!("data: {body}\n\n")
        }
    }
}
