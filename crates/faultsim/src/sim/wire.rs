//! The workers' transports over the simulated network: they only move frames (a request's
//! message to its own gateway, as production routes it), and carry out the plan's
//! mid-transfer faults. Also how the event log names a message or a client output.

use std::collections::{BTreeMap, BTreeSet};

use bulkhead_kv::{Generation, PageId};
use bulkhead_protocol::driver::decode::DecodeLink;
use bulkhead_protocol::driver::prefill::{LinkDown, PrefillLink};
use bulkhead_protocol::gateway::{ClientOutput, gateways_for};
use bulkhead_protocol::prefill::PrefillEvent;
use bulkhead_protocol::{GatewayId, Message, WorkerId};

use crate::dice::Dice;
use crate::net::{ConnId, End, Net};
use crate::plan::{MidTransfer, MidTransferFault};

/// What a prefill worker's chunks set off (the plan's mid-transfer fault), for the loop to
/// carry out once the step is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Aftermath {
    CrashPrefill(Option<u64>),
    CrashDecode(WorkerId, Option<u64>),
    /// The prefill role asked to rejoin the cluster under a new id.
    Rejoin,
}

/// One worker's end of the simulated network, for the length of one call into its driver.
pub(super) struct Port<'a> {
    pub(super) me: WorkerId,
    pub(super) now: u64,
    pub(super) net: &'a mut Net,
    pub(super) dice: &'a mut Dice,
    /// Its gateway connections, by gateway.
    pub(super) gws: &'a BTreeMap<u8, ConnId>,
}

impl Port<'_> {
    fn send(&mut self, conn: ConnId, msg: &Message) {
        self.net.send(conn, End::Worker(self.me), msg, self.now, self.dice);
    }

    /// What the production worker's `Gateways::send` does: to the gateways [`gateways_for`]
    /// picks among this worker's gateway connections.
    fn send_gateway(&mut self, msg: &Message) {
        let gws = self.gws;
        for c in gateways_for(msg, gws.iter().map(|(&g, &c)| (GatewayId(g), c))) {
            self.send(c, msg);
        }
    }
}

/// A prefill worker's transport over the simulated network.
pub(super) struct PrefillWire<'a, 'n> {
    pub(super) port: Port<'a>,
    pub(super) kv: &'a mut BTreeMap<WorkerId, ConnId>,
    /// Decode workers alive now (a connection to one that is gone is refused).
    pub(super) decodes: &'n BTreeSet<WorkerId>,
    pub(super) log: &'a mut Vec<String>,
    pub(super) chunks_sent: &'a mut u64,
    pub(super) mid_transfer: Option<MidTransfer>,
    pub(super) faults: &'a mut u64,
    /// Events about connections this transport opened, for the driver after its call.
    pub(super) events: Vec<PrefillEvent>,
    /// The worker died mid-step: it sends nothing more.
    pub(super) dead: bool,
    pub(super) aftermath: Option<Aftermath>,
}

impl PrefillWire<'_, '_> {
    fn log(&mut self, line: String) {
        self.log.push(format!("{:>6} {line}", self.port.now));
    }
}

impl PrefillLink for PrefillWire<'_, '_> {
    fn to_gateway(&mut self, msg: Message) {
        if !self.dead {
            self.port.send_gateway(&msg);
        }
    }

    fn to_decode(&mut self, to: WorkerId, msg: Message) -> Result<(), LinkDown> {
        let Some(&conn) = self.kv.get(&to) else { return Err(LinkDown(to)) };
        if self.dead {
            return Err(LinkDown(to));
        }
        let chunk = matches!(msg, Message::KvChunk { .. });
        self.port.send(conn, &msg);
        if !chunk {
            return Ok(());
        }
        *self.chunks_sent += 1;
        let Some(m) = self.mid_transfer.filter(|m| m.after_chunks == *self.chunks_sent) else { return Ok(()) };
        *self.faults += 1;
        match m.what {
            MidTransferFault::Cut => {
                self.log(format!("fault: cut KV connection {conn} mid-transfer"));
                self.port.net.cut(conn, self.port.now, self.port.dice);
            }
            MidTransferFault::CrashPrefill => {
                self.dead = true;
                self.aftermath = Some(Aftermath::CrashPrefill(m.restart_after_ms));
                return Err(LinkDown(to));
            }
            MidTransferFault::CrashDecode => self.aftermath = Some(Aftermath::CrashDecode(to, m.restart_after_ms)),
        }
        Ok(())
    }

    fn rejoin(&mut self) {
        self.aftermath = Some(Aftermath::Rejoin);
    }

    /// Opens the KV connection and announces this worker, as the server's does. A decode
    /// worker that is gone refuses the connection.
    fn connect(&mut self, decode: WorkerId, _: &str) {
        let me = self.port.me;
        if !self.decodes.contains(&decode) {
            self.log(format!("w{} cannot connect to w{}: gone", me.0, decode.0));
            return self.events.push(PrefillEvent::DecodeLost { decode });
        }
        let conn = self.port.net.connect(End::Worker(me), End::Worker(decode), self.port.dice);
        self.kv.insert(decode, conn);
        self.port.send(conn, &Message::KvHello { prefill: me });
        self.events.push(PrefillEvent::DecodeConnected { decode });
    }
}

/// A decode worker's transport over the simulated network.
pub(super) struct DecodeWire<'a> {
    pub(super) port: Port<'a>,
    pub(super) kv: &'a BTreeMap<ConnId, Option<WorkerId>>,
    pub(super) handed_out: &'a mut BTreeMap<PageId, Generation>,
}

impl DecodeLink for DecodeWire<'_> {
    fn to_gateway(&mut self, msg: Message) {
        if let Message::Reserved { pages, .. } = &msg {
            self.handed_out.extend(pages.iter().map(|p| (p.page, p.generation)));
        }
        self.port.send_gateway(&msg);
    }

    fn to_prefill(&mut self, to: WorkerId, msg: Message) {
        if let Some(conn) = self.kv.iter().find(|(_, p)| **p == Some(to)).map(|(c, _)| *c) {
            self.port.send(conn, &msg);
        }
    }

    fn disconnect(&mut self, prefill: WorkerId) {
        if let Some(conn) = self.kv.iter().find(|(_, p)| **p == Some(prefill)).map(|(c, _)| *c) {
            self.port.net.close_by(conn, End::Worker(self.port.me), self.port.now, self.port.dice);
        }
    }
}

/// A short, deterministic description of a message for the event log (no error texts:
/// they may name process-wide pool ids).
pub(super) fn brief(m: &Message) -> String {
    match m {
        Message::Hello(h) => format!("Hello {:?} context {}", h.role, h.max_context),
        Message::Welcome { gateway } => format!("Welcome g{}", gateway.0),
        Message::Refuse { .. } => "Refuse".into(),
        Message::DecodePeer { worker, .. } => format!("DecodePeer w{}", worker.0),
        Message::KvHello { prefill } => format!("KvHello w{}", prefill.0),
        Message::PrefillUnreachable { worker } => format!("PrefillUnreachable w{}", worker.0),
        Message::KvLost { decode } => format!("KvLost w{}", decode.0),
        Message::KvKeepalive => "KvKeepalive".into(),
        Message::PeerLeft { worker } => format!("PeerLeft w{}", worker.0),
        Message::Retracted { req, tokens } => format!("Retracted r{req} after {} tokens", tokens.len()),
        Message::Reserve { req, prompt_tokens, max_tokens, prefill, .. } => {
            format!("Reserve r{req} prompt {prompt_tokens} max {max_tokens} via w{}", prefill.0)
        }
        Message::Reserved { req, held, pages, local } => {
            let p: Vec<String> = pages.iter().map(|p| format!("{}@{}", p.page, p.generation)).collect();
            format!("Reserved r{req} held {held} [{}]{}", p.join(" "), if *local { " local" } else { "" })
        }
        Message::Rejected { req, reason, .. } => format!("Rejected r{req} {reason:?}"),
        Message::Prefill { req, tokens, decode, .. } => format!("Prefill r{req} {} tokens to w{}", tokens.len(), decode.0),
        Message::KvChunk { req, header, .. } => {
            format!("KvChunk r{req} page {}@{} slots {}+{}", header.page, header.generation, header.slot_start, header.slot_count)
        }
        Message::Done { req, tokens, first_token, .. } => format!("Done r{req} {tokens} tokens first {first_token}"),
        Message::Fenced { req } => format!("Fenced r{req}"),
        Message::Token { req, token, .. } => format!("Token r{req} {token}"),
        Message::Finished { req, finish, completion_tokens, .. } => format!("Finished r{req} {finish:?} {completion_tokens} tokens"),
        Message::Failed { req, reason, .. } => format!("Failed r{req} {reason:?}"),
        Message::Abort { req, reason } => format!("Abort r{req} {reason:?}"),
        Message::CacheReport { stored, evicted } => format!("CacheReport +{} -{}", stored.len(), evicted.len()),
        Message::Cancel { req } => format!("Cancel r{req}"),
        Message::Metrics { .. } => "Metrics".into(),
        Message::Room => "Room".into(),
        // The handshake and the KV transport negotiation are the transport's, under the
        // roles: never on the simulated wire.
        Message::AuthHello { .. }
        | Message::AuthChallenge { .. }
        | Message::AuthProof { .. }
        | Message::AuthRefused { .. }
        | Message::KvUcxAddress { .. }
        | Message::KvUcxUse { .. } => m.kind_name().into(),
    }
}

pub(super) fn client_brief(out: &ClientOutput) -> String {
    match out {
        ClientOutput::Token { text, .. } => format!("token {text:?}"),
        ClientOutput::Finished { finish, completion_tokens, .. } => format!("finished {finish:?} {completion_tokens} tokens"),
        ClientOutput::Rejected { reason, .. } => format!("rejected {reason:?}"),
        ClientOutput::Failed { reason, .. } => format!("failed {reason:?}"),
        ClientOutput::Unavailable { .. } => "unavailable".into(),
        ClientOutput::Busy { reason, .. } => format!("busy {reason:?}"),
        ClientOutput::OverBudget { .. } => "over budget".into(),
    }
}
