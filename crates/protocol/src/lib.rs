//! Bulkhead's protocol between the gateway, prefill and decode workers.
//!
//! # Layout
//! - [`msg`]: the messages and their fields.
//! - [`codec`]: the versioned, length-prefixed, size-bounded wire format (sans-IO decoder).
//! - [`decode`]: the decode worker's state machine: reservations, chunk verification,
//!   fencing and quarantine (I1, I2, I4), admission (I3, I5).
//! - [`prefill`]: the prefill worker's state machine: its queue, rejection and abort (I3).
//! - [`gateway`]: the gateway's per-request state machine: routing, exactly one terminal
//!   outcome per request (I3).
//!
//! Every state machine is sans-IO: events in, actions out, no sockets, threads or clocks
//! (time arrives as an event), so the same code runs in production, in deterministic fault
//! schedules and under the model checker.
#![forbid(unsafe_code)]

pub mod codec;
pub mod decode;
pub mod gateway;
pub mod msg;
pub mod prefill;

pub use codec::{encode, CodecError, FrameDecoder, DEFAULT_MAX_FRAME, VERSION};
pub use msg::*;
