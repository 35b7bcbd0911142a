//! Bulkhead's protocol between the gateway, prefill and decode workers.
//!
//! # Layout
//! - [`msg`]: the messages and their fields, and the request vocabulary every crate shares
//!   ([`Sampling`], [`FinishReason`]).
//! - [`admission`]: the one admission decision (I3, I5) every role and the engine call.
//! - [`auth`]: cluster trust: the handshake under the cluster key and the per-frame MACs
//!   after it.
//! - [`cache`]: the prefix cache's keys (I7): the secret, a request's scope from its
//!   tenant and salt, chained page keys, the fence the pool checks.
//! - [`codec`]: the versioned, length-prefixed, size-bounded wire format (sans-IO decoder).
//! - [`payload`]: a received KV chunk's bytes, in a buffer its connection reuses.
//! - [`decode`]: the decode worker's state machine: reservations, chunk verification,
//!   fencing and quarantine (I1, I2, I4), admission (I3, I5).
//! - [`prefill`]: the prefill worker's state machine: its queue, rejection and abort (I3).
//! - [`gateway`]: the gateway's state machine: worker membership, routing, exactly one
//!   terminal outcome per request (I3).
//! - [`driver`]: the drivers' core: the prefill job loop and the decode action dispatch,
//!   over transport, model and policy traits, run by the server, the fault schedules and
//!   the model checker alike.
//!
//! Every state machine is sans-IO: events in, actions out, no sockets, threads or clocks
//! (time arrives as an event), so the same code runs in production, in deterministic fault
//! schedules and under the model checker.
#![forbid(unsafe_code)]

pub mod admission;
pub mod auth;
pub mod cache;
pub mod codec;
pub mod decode;
pub mod driver;
pub mod gateway;
pub mod msg;
pub mod payload;
pub mod prefill;

pub use codec::{CodecError, DEFAULT_MAX_FRAME, FrameDecoder, FrameEncoder, VERSION, encode};
pub use msg::*;
pub use payload::Payload;
