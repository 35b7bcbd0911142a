//! The prefill and decode worker processes: blocking threads around the protocol's roles.
//!
//! - [`prefill`], [`decode`]: each worker's main loop, its inbox and its connections.
//! - [`worker`]: what both share: loading, the capacity contract (I5), a worker's failure
//!   that a restart cannot change ([`worker::WorkerError::CannotStart`]).
//! - [`gateways`]: a worker's links to its gateways: registration, routing of each
//!   request's messages to the gateway that made it, dialling a lost one again.
//! - [`core_budget`]: decode steps first when the workers share one host's cores.
//! - [`health`]: a worker's optional liveness and readiness listener for probes.
//!
//! How the workers talk (frames, the door, the handshake, the KV transport, metrics) is in
//! `bulkhead-transport`.
#![forbid(unsafe_code)]

pub mod core_budget;
pub mod decode;
pub mod gateways;
pub mod health;
pub mod prefill;
pub mod worker;
