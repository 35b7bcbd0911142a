//! The drivers' core: the code between a role's actions and the world, written once.
//!
//! A role decides; a driver carries its decisions out: it runs the prefill job loop
//! (take a job, lease its pages, compute a chunk, export it, send its chunks, end the job)
//! and dispatches the decode role's actions to the decode loop. The server's worker
//! processes, the fault schedules (`crates/faultsim`) and the model checker
//! (`crates/modelcheck`) each supply only what differs between them, through traits:
//!
//! - a transport ([`prefill::PrefillLink`], [`decode::DecodeLink`]): where messages go;
//! - a model ([`prefill::PrefillCompute`], [`decode::DecodeEngine`]): what computes KV
//!   and tokens;
//! - a policy ([`prefill::PrefillPolicy`], [`decode::DecodePolicy`]): [`Honest`] in
//!   production; the deliberately broken ones the checkers plant, to show that the checks
//!   catch a driver that misbehaves, are in `sabotage` (feature `sabotage`), here beside
//!   the code they break, so that neither checker depends on the other.
//!
//! So a bug put into this module is a bug in every one of them, and the checkers verify
//! the code that production runs. Like the roles, it has no sockets, threads or clocks.

use bulkhead_fingerprint::Fingerprint;
pub mod decode;
pub mod prefill;
#[cfg(feature = "sabotage")]
pub mod sabotage;

/// The production policy: drivers that do exactly what the roles decide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Fingerprint)]
pub struct Honest;
