//! The workers' transports in the model: they put messages onto the network (a request's
//! message to its own gateway, as production routes it) and keep the ghost state the
//! properties read (reservations, refusals, chunks sent after a rejection).

use std::collections::{BTreeMap, BTreeSet};

use bulkhead_kv::RequestId;
use bulkhead_protocol::driver::decode::DecodeLink;
use bulkhead_protocol::driver::prefill::{LinkDown, PrefillLink};
use bulkhead_protocol::gateway::{client_of, gateways_for};
use bulkhead_protocol::{GatewayId, Message, RejectReason, WorkerId};

use super::{DECODE, Envelope, Ghost, Net, Node, Prop, request};
use crate::config::Config;

/// Puts `m` on the connection `from → to`, unless `to` is a prefill worker that is gone (a
/// write to a closed socket).
pub(super) fn put(net: &mut Net, alive: &Reach, from: Node, to: Node, m: Message) {
    match to {
        Node::Prefill(id) if !alive.prefills.contains(&id) => return,
        Node::Gateway(g) if !alive.gateways.contains(&g) => return,
        _ => {}
    }
    net.entry((from, to)).or_default().push_back(Envelope::Msg(m));
}

/// The processes a message can still be written to: live prefill workers and gateways.
pub(super) struct Reach {
    pub(super) prefills: BTreeSet<WorkerId>,
    pub(super) gateways: BTreeSet<u8>,
}

impl Reach {
    /// Where a worker's message to "the gateway" goes: the live gateways that
    /// [`gateways_for`] picks, as the production worker's gateway links do.
    pub(super) fn gateways_for<'r>(&'r self, msg: &Message) -> impl Iterator<Item = Node> + use<'r> {
        gateways_for(msg, self.gateways.iter().map(|&g| (GatewayId(g), Node::Gateway(g))))
    }
}

/// A prefill worker's transport: onto the network, watching for chunks of requests that
/// were rejected (I3). Its KV connection to the decode worker is open from its start.
pub(super) struct PrefillWire<'a> {
    pub(super) me: WorkerId,
    pub(super) net: &'a mut Net,
    pub(super) alive: &'a Reach,
    pub(super) ghosts: &'a BTreeMap<RequestId, Ghost>,
    pub(super) seen: Vec<(Prop, String)>,
}

impl PrefillLink for PrefillWire<'_> {
    fn to_gateway(&mut self, msg: Message) {
        for to in self.alive.gateways_for(&msg) {
            put(self.net, self.alive, Node::Prefill(self.me), to, msg.clone());
        }
    }

    fn to_decode(&mut self, to: WorkerId, msg: Message) -> Result<(), LinkDown> {
        if to != DECODE {
            return Err(LinkDown(to));
        }
        if let Message::KvChunk { req, .. } = &msg
            && self.ghosts.get(&client_of(*req)).is_some_and(|g| g.rejected)
        {
            self.seen.push((Prop::RejectionTerminal, format!("chunk for {req} sent after it was rejected")));
        }
        put(self.net, self.alive, Node::Prefill(self.me), Node::Decode, msg);
        Ok(())
    }

    /// Registration is atomic in the model: a worker's KV connection is open from its
    /// start, so no introduction ever arrives.
    fn connect(&mut self, _: WorkerId, _: &str) {}

    /// KV connections are never cut in the model, so no worker rejoins.
    fn rejoin(&mut self) {}
}

/// The decode worker's transport: onto the network, keeping the ghost state of
/// reservations and refusals.
pub(super) struct DecodeWire<'a> {
    pub(super) cfg: &'a Config,
    pub(super) net: &'a mut Net,
    pub(super) alive: &'a Reach,
    pub(super) ghosts: &'a mut BTreeMap<RequestId, Ghost>,
    pub(super) seen: Vec<(Prop, String)>,
}

impl DecodeLink for DecodeWire<'_> {
    fn to_gateway(&mut self, msg: Message) {
        match &msg {
            Message::Rejected { req, reason, .. } => worker_rejected(self.ghosts, client_of(*req), *reason),
            Message::Retracted { req, tokens } => self.ghosts.entry(client_of(*req)).or_default().resumed = tokens.len(),
            Message::Reserved { req, held, local, .. } => {
                let client = client_of(*req);
                let g = self.ghosts.entry(client).or_default();
                if g.rejected {
                    self.seen.push((Prop::RejectionTerminal, format!("decode reserved pages for {client} after it was rejected")));
                }
                g.reserved_prompt = request(self.cfg, client).map(|r| r.prompt as usize + g.resumed);
                if g.attempt != Some(*req) {
                    g.attempt = Some(*req);
                    g.landed = 0;
                }
                g.held = *held as usize;
                g.local = *local;
            }
            _ => {}
        }
        for to in self.alive.gateways_for(&msg) {
            put(self.net, self.alive, Node::Decode, to, msg.clone());
        }
    }

    fn to_prefill(&mut self, to: WorkerId, msg: Message) {
        put(self.net, self.alive, Node::Decode, Node::Prefill(to), msg);
    }

    /// Connections are open from a worker's start in the model, never refused.
    fn disconnect(&mut self, _: WorkerId) {}
}

/// A worker refused a request. Refusing it for its context decides the request's fate
/// (I3); a refusal for capacity means "not now" (the gateway queues it again), and one of
/// a duplicate message is about the message: those become the request's fate only if the
/// gateway passes them to the client.
pub(super) fn worker_rejected(ghosts: &mut BTreeMap<RequestId, Ghost>, req: RequestId, reason: RejectReason) {
    if reason == RejectReason::ContextLength {
        ghosts.entry(req).or_default().rejected = true;
    }
}

/// Where the decode driver's actions go when it is told of a connection (none come).
pub(super) struct Nowhere;

impl DecodeLink for Nowhere {
    fn to_gateway(&mut self, _: Message) {}
    fn to_prefill(&mut self, _: WorkerId, _: Message) {}
    fn disconnect(&mut self, _: WorkerId) {}
}
