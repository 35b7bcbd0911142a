//! The KV handoff protocol, model-checked on the production state machines.
//!
//! - The pinned configurations hold every property, and their state counts are pinned: a
//!   change in the model or in the production roles shows here.
//! - Every property fails on a deliberately broken driver: the checker finds the bug.
//! - Findings: what the production protocol does not hold, and under which assumption.

use bulkhead_modelcheck::{Action, Config, HandoffModel, Report, Variant, World, check, find, names};

/// Checks every property of `cfg` to the end and returns the report (printed).
fn check_all(cfg: Config) -> (Report, HandoffModel) {
    let model = HandoffModel::new(cfg.clone());
    let report = check(cfg, false);
    eprintln!("{report}");
    (report, model)
}

/// Asserts the checker finds a counterexample to `property` in `cfg`; returns the violation
/// text of the final state.
fn finds(cfg: Config, property: &'static str) -> String {
    let report = find(cfg, property);
    eprintln!("{report}");
    let Some((path, last)) = report.discoveries.get(property) else {
        panic!("no counterexample to {property:?} in {} ({:?}) after {} states", report.name, report.variant, report.unique_states)
    };
    assert!(!path.is_empty());
    last.clone()
}

fn assert_holds(report: &Report, model: &HandoffModel) {
    assert_eq!(report.failures(model), Vec::<&str>::new(), "{report}");
    assert!(report.discoveries.contains_key(names::SERVED), "the happy path is reachable: {report}");
}

/// The pinned counts. Since the driver core (issue 12) the model runs the production
/// drivers. The dependable-service issue (13) grew both configurations: requests that do
/// not fit now wait in the gateway's queue (a Capacity refusal requeues them instead of
/// failing them), each attempt has its own id and KV values, the decode worker announces
/// freed pages with `Room`, a prefill worker's departure reaches the decode worker as
/// `PeerLeft`, and a request whose prefill was lost is retried once. Three requests went
/// from 64,506 to 96,935 states. The faulty network went from 394,958 to 1,818,421 with
/// its prefill tick (eight minutes even optimised), so that tick moved out: the keepalive
/// configuration exercises keepalives, and without it the faulty network has 471,665.
/// The gateway's in-flight record came to remember whether a decode worker has refused a
/// request for room (so `requeued_capacity` counts requests, not refusals): the faulty
/// network went from 526,737 to 527,718, the states where that is all that differs. The
/// typed fingerprint (`derive(Fingerprint)`) that replaced the canonicalised `Debug` text
/// left every count here unchanged. Several gateways (issue 34) made a prefill worker
/// answer a decode worker's abort of a job it does not have with its fence (and refuse
/// the job if it comes later), so that a reservation whose gateway died before sending the
/// job is not quarantined for ever: that abort is no longer a no-op the checker may deliver
/// at once, and every configuration with a transfer timeout grew (three requests from
/// 105,067 to 259,038, the faulty network from 527,718 to 968,038, keepalives from 374 to
/// 456, batched prefill from 16,696 to 31,897). And a decode worker told that a prefill
/// worker left a gateway while its KV connection is still open fails that gateway's
/// reservations for it at once and asks it for their fences (it may live on for other
/// gateways, so its connection's close may never come): where a prefill worker crashes,
/// the gateway's word and the connection's close now race to that end (the faulty
/// network to 1,664,866, `ucx-restart` from 3,113 to 8,046). The queue's order by each
/// tenant's recent prefill use (instead of round robin) is state the gateway keeps: three
/// requests to 265,744, the faulty network to 1,744,845, the decode cache from 4,677 to
/// 5,129 and its local rest from 3,383 to 4,013.
#[test]
fn three_requests_two_prefill_workers_one_decode_worker_hold_every_property() {
    let (report, model) = check_all(Config::three_requests());
    assert_holds(&report, &model);
    assert_eq!(report.unique_states, 265_744, "the model changed: {report}");
}

/// With a prefill window of one token every prompt waits at the gateway until the prefill
/// worker it would go to has none in flight (a prompt always goes to an idle one): every
/// property holds, and no request is left waiting for a window that never frees.
#[test]
fn a_prefill_window_holds_every_property_and_leaves_no_request_waiting() {
    for cfg in [Config::three_requests(), Config::faulty_network()] {
        let cfg = Config { prefill_window_tokens: 1, ..cfg };
        let (report, model) = check_all(cfg);
        assert_holds(&report, &model);
    }
}

#[test]
fn lost_messages_crashes_aborts_and_timeouts_break_no_safety_property() {
    let (report, model) = check_all(Config::faulty_network());
    assert_holds(&report, &model);
    assert_eq!(report.unique_states, 1_744_845, "the model changed: {report}");
}

/// Runs one request of the three-request configuration to its end, taking every action but
/// faults in a fixed order, and the decode worker's one tick as soon as `tick_now` says so.
fn walk_with_one_decode_tick(cfg: &Config, tick_now: impl Fn(&World) -> bool) -> World<'_> {
    let mut w = World::new(cfg);
    let mut ticked = false;
    for _ in 0..200 {
        let enabled = w.enabled();
        if !ticked && enabled.contains(&Action::DecodeTick) && tick_now(&w) {
            ticked = true;
            w.apply(&Action::DecodeTick);
            continue;
        }
        let next = enabled
            .into_iter()
            .find(|a| matches!(a, Action::Submit(_) | Action::Deliver(..) | Action::PrefillStep(_) | Action::DecodeStep(_)));
        let Some(a) = next else { break };
        w.apply(&a);
    }
    assert!(ticked, "the decode tick was never taken");
    w.check_state();
    assert!(w.violations().is_empty(), "{:?}", w.violations());
    assert!(w.is_clean(), "{}", w.dump());
    w
}

fn one_request() -> Config {
    let mut cfg = Config::three_requests();
    cfg.requests.truncate(1);
    cfg
}

/// The decode timeout is a silence timer (any frame from the prefill re-arms it; this walk
/// takes no prefill tick, so no keepalive): a transfer that started and then stalled times
/// out in the model, and its pages come back only through the fence...
#[test]
fn a_transfer_that_stalls_after_a_chunk_times_out_in_the_model() {
    use bulkhead_modelcheck::world::Outcome;
    use bulkhead_protocol::FailReason;
    let cfg = one_request();
    let w = walk_with_one_decode_tick(&cfg, |w| w.ghosts().values().any(|g| g.landed > 0));
    let outcomes: Vec<_> = w.ghosts().values().map(|g| g.outcomes.clone()).collect();
    assert_eq!(outcomes, [vec![Outcome::Failed(FailReason::Timeout)]]);
}

/// ... and so does a reservation whose prefill has said nothing since it was made.
#[test]
fn a_reservation_whose_prefill_stays_silent_times_out_in_the_model() {
    use bulkhead_modelcheck::world::Outcome;
    use bulkhead_protocol::FailReason;
    let cfg = one_request();
    let w = walk_with_one_decode_tick(&cfg, |w| w.ghosts().values().all(|g| g.reserved_prompt.is_some() && g.landed == 0));
    let outcomes: Vec<_> = w.ghosts().values().map(|g| g.outcomes.clone()).collect();
    assert_eq!(outcomes, [vec![Outcome::Failed(FailReason::Timeout)]]);
}

/// With half-timeout decode ticks, a keepalive from the prefill role's tick (the
/// production driver's) that arrives between the two decode ticks keeps a waiting
/// reservation alive, and the request finishes; without it the same two ticks time it out.
#[test]
fn a_keepalive_between_two_decode_ticks_keeps_a_waiting_reservation_alive() {
    use bulkhead_modelcheck::world::{Node, Outcome};
    use bulkhead_protocol::FailReason;
    let cfg = Config::keepalive();
    for keepalive in [true, false] {
        let mut w = World::new(&cfg);
        let (mut ticks, mut kept_alive) = (0, false);
        for _ in 0..200 {
            let enabled = w.enabled();
            let waiting = w.ghosts().values().all(|g| g.reserved_prompt.is_some() && g.landed == 0);
            let pick = if waiting && ticks == 0 && enabled.contains(&Action::DecodeTick) {
                Action::DecodeTick
            } else if waiting && ticks == 1 && keepalive && !kept_alive {
                let tick = enabled.iter().find(|a| matches!(a, Action::PrefillTick(_))).cloned();
                let Some(tick) = tick else { panic!("no prefill tick while a reservation waits: {enabled:?}") };
                kept_alive = true;
                tick
            } else if waiting
                && ticks == 1
                && enabled.contains(&Action::Deliver(Node::Prefill(bulkhead_protocol::WorkerId(2)), Node::Decode))
            {
                Action::Deliver(Node::Prefill(bulkhead_protocol::WorkerId(2)), Node::Decode)
            } else if waiting && ticks == 1 && enabled.contains(&Action::DecodeTick) {
                Action::DecodeTick
            } else {
                let next = enabled
                    .into_iter()
                    .find(|a| matches!(a, Action::Submit(_) | Action::Deliver(..) | Action::PrefillStep(_) | Action::DecodeStep(_)));
                let Some(a) = next else { break };
                a
            };
            if pick == Action::DecodeTick {
                ticks += 1;
            }
            w.apply(&pick);
        }
        assert_eq!((ticks, kept_alive), (2, keepalive), "{}", w.dump());
        w.check_state();
        assert!(w.violations().is_empty(), "{:?}", w.violations());
        let outcomes: Vec<_> = w.ghosts().values().map(|g| g.outcomes.clone()).collect();
        let want = if keepalive { Outcome::Finished } else { Outcome::Failed(FailReason::Timeout) };
        assert_eq!(outcomes, [vec![want]], "keepalive {keepalive}: {}", w.dump());
        assert!(w.is_clean(), "{}", w.dump());
    }
}

#[test]
fn keepalives_and_half_timeout_ticks_hold_every_property() {
    let (report, model) = check_all(Config::keepalive());
    assert_holds(&report, &model);
    assert_eq!(report.unique_states, 456, "the model changed: {report}");
}

// ------------------------------------------------------------------ broken variants

#[test]
fn decode_trusting_done_is_caught_by_the_coverage_property() {
    // A lost chunk makes the transfer short; the verifier refuses the claim, the broken
    // driver starts the request anyway.
    let mut cfg = Config::faulty_network().with_variant(Variant::TrustDone);
    cfg.requests.truncate(1);
    let last = finds(cfg, names::VERIFIED_COVERAGE);
    assert!(last.contains("started with"), "{last}");
}

#[test]
fn attending_past_the_watermark_is_caught_by_the_read_property() {
    let last = finds(Config::three_requests().with_variant(Variant::ReadPastWatermark), names::READ_ISOLATION);
    assert!(last.contains("past the watermark"), "{last}");
}

/// The three-request configuration with only its request that is over the prefill
/// workers' limit.
fn over_capacity_only() -> Config {
    let mut cfg = Config::three_requests();
    let over: Vec<_> = cfg.requests.iter().copied().filter(|r| cfg.over_capacity(*r)).collect();
    cfg.requests = over;
    cfg
}

#[test]
fn running_a_rejected_prompt_anyway_is_caught_by_the_rejection_property() {
    let last = finds(over_capacity_only().with_variant(Variant::KeepRejectedJob), names::REJECTION_TERMINAL);
    assert!(last.contains("after it was rejected"), "{last}");
}

#[test]
fn releasing_quarantine_on_timeout_is_caught_by_the_late_write_property() {
    let last = finds(Config::three_requests().with_variant(Variant::ReleaseQuarantineOnTick), names::NO_LATE_WRITES);
    assert!(last.contains("may still write it"), "{last}");
}

#[test]
fn releasing_quarantine_on_timeout_is_caught_by_the_single_lease_property() {
    let last = finds(Config::three_requests().with_variant(Variant::ReleaseQuarantineOnTick), names::SINGLE_LEASE);
    assert!(last.contains("is leased to"), "{last}");
}

#[test]
fn retrying_a_refused_request_is_caught_by_the_one_outcome_property() {
    let last = finds(Config::three_requests().with_variant(Variant::RetryAfterReject), names::ONE_OUTCOME);
    assert!(last.contains("two terminal outcomes"), "{last}");
}

#[test]
fn dropping_fences_is_caught_by_the_liveness_property() {
    let mut cfg = Config::three_requests().with_variant(Variant::DropFence);
    cfg.requests.truncate(1);
    let last = finds(cfg, names::ENDS_CLEAN);
    assert!(last.contains("quarantined_pages: 2"), "{last}");
}

/// Two gateways over one prefill and one decode worker (issue 34), each counting only its
/// own reservations against the decode pool: the decode worker, the pool's authority,
/// refuses what does not fit with `Capacity` and the gateway waits for `Room`, so no page
/// is ever in two leases (I1) and both requests finish; and a gateway that dies with a
/// request in flight costs the other gateway's request nothing while the workers end the
/// dead one's requests on their own (every pool ends full). Request ids carry their gateway,
/// so the two gateways' requests never meet on a worker.
#[test]
fn two_gateways_share_a_decode_pool_without_over_committing_it_and_survive_one_dying() {
    let (report, model) = check_all(Config::two_gateways());
    assert_holds(&report, &model);
    assert!(report.discoveries.contains_key(names::CONTENDED), "no Capacity refusal between the gateways: {report}");
    assert!(report.discoveries.contains_key(names::SURVIVED), "no gateway died harmlessly: {report}");
    assert_eq!(report.unique_states, 38_174, "the model changed: {report}");
}

/// A decode worker that ignores a lost gateway keeps its requests' pages for clients that
/// are gone: caught by the liveness property (pools never end full).
#[test]
fn a_decode_worker_ignoring_a_lost_gateway_is_caught_by_the_liveness_property() {
    let last = finds(Config::two_gateways().with_variant(Variant::IgnoreGatewayLoss), names::ENDS_CLEAN);
    assert!(last.contains("(dead)"), "{last}");
}

/// KV on demand (issue 13): the older request's growth retracts the newer one when both
/// run; its pages go back through the pool's release path and it resumes, as a new
/// attempt, from the token it made. Every property holds and that path is reachable.
#[test]
fn growth_and_retraction_hold_every_property_and_a_retracted_request_still_finishes() {
    let (report, model) = check_all(Config::growth());
    assert_holds(&report, &model);
    assert!(report.discoveries.contains_key(names::RESUMED), "no retraction was reached: {report}");
    // 268 before a retraction made the decode worker owe the gateway a `Room`.
    assert_eq!(report.unique_states, 280, "the model changed: {report}");
}

/// A scheduler that frees a victim's pages for a grower but forgets to take the victim out
/// of the loop: the pool gave each freed page a new generation, so the victim's next write
/// or read through its old leases is refused, and the checker reports it.
#[test]
fn a_victim_left_running_on_its_old_leases_is_caught_by_the_read_property() {
    let last = finds(Config::growth().with_variant(Variant::KeepRetractedRunning), names::READ_ISOLATION);
    assert!(last.contains("stale lease"), "{last}");
}

/// Speculative decoding: the decode loop feeds drafts, accepts a different number at each
/// step and rolls the rejected ones' KV back through the driver core's `Verification`,
/// beside growth, retraction and a client abort. Every property holds and a retracted
/// request still finishes.
#[test]
fn speculation_with_rejections_everywhere_holds_every_property() {
    let (report, model) = check_all(Config::speculation());
    assert_holds(&report, &model);
    assert!(report.discoveries.contains_key(names::RESUMED), "no retraction was reached: {report}");
    assert_eq!(report.unique_states, 1348, "the model changed: {report}");
}

/// A decode loop that leaves a speculative step's rejected drafts' KV in place attends to
/// it at the next step: the read property sees a position that does not hold the
/// request's own KV.
#[test]
fn rejected_drafts_left_in_place_are_caught_by_the_read_property() {
    let last = finds(Config::speculation().with_variant(Variant::KeepRejectedDrafts), names::READ_ISOLATION);
    assert!(last.contains("not its own KV"), "{last}");
}

/// The prefix cache (issue 14): two tenants send the same prompt; tenant 0's second
/// request shares its cached page, tenant 1's never does, the cached page is evicted when
/// another prompt needs the prefill pool (never while read), and a client may leave while
/// its request holds a cached page. Every property holds, the fence included, and the
/// happy path (everything served, pools idle) is reachable.
#[test]
fn the_prefix_cache_shares_within_a_tenant_only_and_holds_every_property() {
    let (report, model) = check_all(Config::prefix_cache());
    assert_holds(&report, &model);
    assert!(report.discoveries.contains_key(names::SHARED), "no hit and eviction on the happy path: {report}");
    assert_eq!(report.unique_states, 9_693, "the model changed: {report}");
}

/// Batched prefill (issue 17): one prefill worker runs two two-page prompts at once, so a
/// step computes a page of each and their chunks interleave on the KV connection, while a
/// client may leave and a transfer may time out at any point. Every property holds and the
/// interleaving is reached on the happy path.
#[test]
fn batched_prefill_interleaves_two_jobs_and_holds_every_property() {
    let (report, model) = check_all(Config::batched_prefill());
    assert_holds(&report, &model);
    assert!(report.discoveries.contains_key(names::BATCHED), "no batched step on the happy path: {report}");
    assert_eq!(report.unique_states, 31_897, "the model changed: {report}");
}

/// Page keys that leave the tenant out give both tenants' equal prompts equal keys: the
/// second tenant's lookup finds the first one's page, and the pool's fence refuses it (the
/// request fails instead of reading). The checker reports the refused lookup.
#[test]
fn cache_keys_without_the_tenant_are_caught_by_the_fence_property() {
    let last = finds(Config::prefix_cache().with_variant(Variant::UnscopedCacheKeys), names::CACHE_FENCE);
    assert!(last.contains("of another tenant"), "{last}");
}

/// The decode-side cache (design I10): tenant 0's second request may find the first one's
/// full page on the decode worker and receive only the rest of its prompt, tenant 1's never
/// does; a cached page is evicted when another reservation needs room (never while shared,
/// also while a transfer is under way), and a client may leave during a hit. Every property
/// holds, the holders' shared pages are always the pool's live shared leases, and the
/// happy path (a hit and an eviction, everything served, pools idle) is reachable.
#[test]
fn the_decode_cache_shares_within_a_tenant_only_and_holds_every_property() {
    let (report, model) = check_all(Config::decode_cache());
    assert_holds(&report, &model);
    assert!(report.discoveries.contains_key(names::SHARED), "no decode-side hit and eviction on the happy path: {report}");
    assert_eq!(report.unique_states, 5_129, "the model changed: {report}");
}

/// A decode driver that keeps every reservation under one scope lets tenant 1's prompt hit
/// tenant 0's decode-side page; the fence (derived from the same scope) cannot tell, and
/// the read of another tenant's KV is caught.
#[test]
fn a_decode_side_hit_across_tenants_is_caught() {
    let last = finds(Config::decode_cache().with_variant(Variant::OneDecodeScope), names::READ_ISOLATION);
    assert!(last.contains("not its own KV"), "{last}");
}

/// A decode-side hit whose rest is short is computed by the decode loop itself: no
/// `Prefill`, no chunk; coverage is the shared prefix plus what the loop wrote and
/// committed, exactly the prompt, and only when the worker said so. Every property holds,
/// and the happy path reaches such a local compute.
#[test]
fn a_short_rest_computed_on_the_decode_worker_holds_every_property() {
    let (report, model) = check_all(Config::decode_local());
    assert_holds(&report, &model);
    assert!(report.discoveries.contains_key(names::LOCAL), "no local compute on the happy path: {report}");
    assert_eq!(report.unique_states, 4_013, "the model changed: {report}");
}

/// With the rest computed on the decode worker, a driver that keeps every reservation
/// under one scope still lets tenant 1 hit tenant 0's page, and the read is still caught.
#[test]
fn a_decode_side_hit_across_tenants_is_caught_when_the_rest_is_computed_there() {
    let last = finds(Config::decode_local().with_variant(Variant::OneDecodeScope), names::READ_ISOLATION);
    assert!(last.contains("not its own KV"), "{last}");
}

// ------------------------------------------------------------------ findings

/// The protocol relies on exactly-once delivery per connection (TCP): a duplicated
/// `Prefill` is refused as a duplicate, the gateway takes that refusal for the request's
/// outcome (the client gets 400) while the first copy's job runs on and transfers.
#[test]
fn finding_a_duplicated_prefill_message_outlives_its_rejection() {
    let last = finds(Config::duplicating_network(), names::REJECTION_TERMINAL);
    assert!(last.contains("after it was rejected"), "{last}");
}

/// The same assumption, for I4: `Fenced` is the last message for a request only if the
/// `Prefill` before it was delivered once; a duplicate revives the job after the fence
/// released the pages (its chunks are then dropped as late: the verifier holds).
#[test]
fn finding_a_duplicated_prefill_message_writes_after_its_fence() {
    finds(Config::duplicating_network(), names::NO_LATE_WRITES);
}

/// The protocol relies on in-order delivery per connection (TCP): `Done` overtaking the
/// last chunk fails the coverage check and releases the pages while that chunk is on the
/// wire (it is then dropped as late: the verifier holds).
#[test]
fn finding_done_overtaking_a_chunk_releases_pages_under_it() {
    finds(Config::reordering_network(), names::NO_LATE_WRITES);
}

/// Was a real leak, found by this checker: when decode saw `PrefillClosed` before the
/// gateway saw the worker leave, the gateway could still route a request to the dead
/// worker; decode reserved pages naming it, the gateway's abort quarantined them, and the
/// fence they waited for could never come. Decode now remembers closed prefill connections
/// and releases such pages: every run of this configuration ends clean.
#[test]
fn a_reservation_naming_a_closed_prefill_connection_is_released_not_quarantined_for_ever() {
    let (report, model) = check_all(Config::prefill_restart());
    assert_holds(&report, &model);
}

/// The UCX road (issue 19): a prefill's close may reach the decode worker ahead of frames
/// it sent, which are then dropped with the reader (two-sided delivery). Every property
/// holds: nothing lands after the close, and what the close cut off fails cleanly.
#[test]
fn a_close_that_overtakes_frames_over_ucx_holds_every_property() {
    let (report, model) = check_all(Config::ucx_restart());
    assert_holds(&report, &model);
    assert_eq!(report.unique_states, 8_046, "the model changed: {report}");
}

/// The design UCX must not have: frames written one-sided into the decode worker's memory
/// land after it saw the close and fenced their writer (an RDMA write that was issued
/// cannot be withdrawn), into pages already released.
#[test]
fn one_sided_writes_that_outlive_the_close_are_caught_by_the_late_write_property() {
    let last = finds(Config::ucx_restart().with_variant(Variant::OneSidedWrites), names::NO_LATE_WRITES);
    assert!(last.contains("may still write it"), "{last}");
}

/// Was a race, found by this checker: with the gateway's own check off, a prompt over the
/// prefill workers' limit is refused by the prefill (`Rejected` to the gateway, `Fenced` to
/// decode); decode used to answer the fence with `Failed(WorkerLost)`, and the gateway took
/// whichever arrived first, so the client could get a failure instead of its 400. Decode now
/// releases silently on a fence: the terminal outcome always comes from the prefill or the
/// gateway.
#[test]
fn an_over_capacity_prompt_is_always_answered_with_its_original_error() {
    let mut cfg = Config::three_requests();
    cfg.faults = Default::default();
    cfg.check_original_error = true;
    let (report, model) = check_all(cfg);
    assert_holds(&report, &model);
}

#[test]
fn replay_is_deterministic() {
    let cfg = Config::three_requests();
    let mut w = World::new(&cfg);
    let mut history = Vec::new();
    for i in 0..24 {
        let enabled = w.enabled();
        let Some(a) = enabled.get(i * 5 % enabled.len().max(1)).cloned() else { break };
        w.apply(&a);
        history.push(a);
    }
    let fingerprint = |w: &World| {
        let mut h = bulkhead_fingerprint::Fingerprinter::new();
        w.fingerprint(&mut h);
        h.finish()
    };
    let a = fingerprint(&World::replay(&cfg, &history));
    assert_eq!(a, fingerprint(&World::replay(&cfg, &history)));
    assert_eq!(a, fingerprint(&w));
}
