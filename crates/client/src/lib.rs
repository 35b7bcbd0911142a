//! Client tools for any OpenAI-compatible server: a load generator and the isolation probe.
//!
//! # Layout
//! - [`http`]: a minimal HTTP/1.1 client (one request per connection, bounded waits, no TLS).
//! - [`sse`]: incremental server-sent-events parsing.
//! - [`openai`]: `/v1/models` and (chat) completions, streamed or not, timed per chunk.
//! - [`dist`]: seeded generator, length distributions, filler text and random codes.
//! - [`stats`]: percentiles, latency summaries and the two-sample Kolmogorov–Smirnov test.
//! - [`report`]: the one report type of the load generator's modes, a [`report::Tally`]:
//!   counts, failures by kind, tokens, latency percentiles and SLO attainment, as text and
//!   flat JSON.
//! - [`loadgen`]: N concurrent streaming clients; throughput, TTFT and inter-token latency.
//! - [`openloop`]: open-loop (Poisson) arrivals at one or more rates; SLO attainment per
//!   rate and goodput, the highest rate at which 90% of requests meet a TTFT and a TPOT SLO.
//! - [`multiturn`]: concurrent multi-turn chats of several tenants, each with its own
//!   shared system prompt; TTFT by turn and the prompt tokens the server took from cache.
//! - [`probe`]: tenant A plants canaries while tenant B sends long, over-context, aborted
//!   and disconnected requests; reports cross-over, accepted over-context prompts and long
//!   inputs whose answers ignore their own content.
//! - [`timing`]: the prompt-cache timing audit: are tenant A's cached prompts measurably
//!   faster for tenant B (a two-sample Kolmogorov–Smirnov test on time to first token)?
#![forbid(unsafe_code)]

pub mod dist;
pub mod http;
pub mod loadgen;
pub mod multiturn;
pub mod openai;
pub mod openloop;
pub mod probe;
pub mod report;
pub mod sse;
pub mod stats;
pub mod timing;

use std::time::Duration;

pub use openai::{Api, Client, ClientConfig, CompletionRequest, HangUp, Outcome};

/// Why a request or a run could not be carried out. (What a server answered — a 4xx, an
/// error event — is not an error here; it is part of an [`Outcome`].)
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL cannot be used.
    #[error("invalid URL `{url}`: {why}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// A header name or value contains a line break.
    #[error("header `{0}` contains a line break")]
    Header(String),
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// A wait ran out.
    #[error("timed out after {after:?} {what}")]
    Timeout {
        /// What was being waited for.
        what: &'static str,
        /// The limit.
        after: Duration,
    },
    /// The server's bytes are not valid HTTP, SSE or JSON where they must be.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The server answered a request that must succeed with an error status.
    #[error("HTTP {status}: {body}")]
    Status {
        /// Status code.
        status: u16,
        /// Body (truncated by the caller if needed).
        body: String,
    },
    /// The settings cannot work (e.g. no bound on a run, a context too small for a test).
    #[error("invalid settings: {0}")]
    Config(String),
    /// So many requests failed that a measurement would mean nothing.
    #[error("{failed} requests failed; the last: {last}")]
    TooManyFailures {
        /// Requests that failed.
        failed: usize,
        /// The last failure, in words.
        last: String,
    },
}

impl ClientError {
    /// A short stable name of the error kind, for counting errors in reports.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Url { .. } | ClientError::Header(_) | ClientError::Config(_) => "config",
            ClientError::Io { .. } => "io",
            ClientError::Timeout { .. } => "timeout",
            ClientError::Protocol(_) => "protocol",
            ClientError::Status { .. } => "status",
            ClientError::TooManyFailures { .. } => "failures",
        }
    }
}
