// A C++ engine's control plane against a running kv-rendezvous, step by step as docs/engines.md describes it:
// register a consumer and a producer (leases renewed over KeepAlive), run one push transfer through its
// lifecycle while following both engines' Watch streams, read the ErrorInfo of refused calls (an item's and a
// whole call's), see a pair whose layouts differ aborted at match, survive a lease that lapses, and, given a proxy
// to talk through, a connection that drops (KeepAlive reopened, Watch resumed, a resync rebuilt) and one that goes
// silent (found by keepalive pings); given several replicas, the stop of the one it talks to. The agents are
// stand-ins: no NIXL, so the producer reports the write without making it (docs/engines.md, "Testing").
//
//   rendezvous_client TARGET [PROXY_HOST:PORT EVENTS_KEPT] [--keepalive TIME_MS,TIMEOUT_MS]
//     prints "ok ..." per step; exits 1 at the first step that goes wrong. TARGET: HOST:PORT, or several replicas
//     of the service on one store as ipv4:IP:PORT,IP:PORT (engine.h, Connect): the caller then stops the replica
//     the engines talk to when asked (Ask). PROXY_HOST:PORT: a TCP proxy to the service that the caller cuts,
//     freezes and lets through again when asked; EVENTS_KEPT: the server's --max-events-per-engine, which a step
//     overruns to provoke a resync. --keepalive: the channels' HTTP/2 keepalive pings (default 30000,10000).
//
// The engine's pieces (the channel, Engine, Lease, Watch) are in engine.h: the part to copy.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"

namespace v1 = rendezvous::v1;
using rendezvous_engine::Connect;
using rendezvous_engine::Engine;
using rendezvous_engine::ErrorInfoOf;
using rendezvous_engine::Expect;
using rendezvous_engine::KeepAlivePings;
using rendezvous_engine::KnownReason;
using rendezvous_engine::Lease;
using rendezvous_engine::Ok;
using rendezvous_engine::Stub;
using rendezvous_engine::Watch;

namespace {

void PushLifecycle(Engine& decode, Engine& prefill, Watch& decode_events, Watch& prefill_events,
                   const std::string& transfer_id) {
  v1::ItemResult targeted = decode.RegisterTargets(transfer_id, {7, 8, 9});
  Expect(targeted.state() == v1::TRANSFER_STATE_TARGETED, "RegisterTargets: TARGETED");
  v1::ItemResult claimed = prefill.Claim(transfer_id);
  Expect(claimed.state() == v1::TRANSFER_STATE_MATCHED, "ClaimTransfers: MATCHED");
  v1::Event assigned = prefill_events.Next(v1::EVENT_TYPE_TRANSFER_ASSIGNED, transfer_id);
  const auto& blocks = assigned.transfer().target_block_ids();
  Expect(std::vector<int64_t>(blocks.begin(), blocks.end()) == std::vector<int64_t>{7, 8, 9}, "assigned blocks");
  Expect(assigned.peer().engine_id() == decode.id() && assigned.peer().agents(0).metadata() == "md-" + decode.id(),
         "the assignment names the consumer and its agent metadata");
  // A real producer WRITEs the blocks with NIXL here, notification "4 <transfer_id>:<generation>", then reports;
  // it frees its source blocks once this report is answered.
  v1::ItemResult committed = prefill.Complete(transfer_id, assigned.generation());
  Expect(committed.state() == v1::TRANSFER_STATE_COMMITTED, "CompleteTransfers: COMMITTED");
  v1::Event commit = decode_events.Next(v1::EVENT_TYPE_TRANSFER_COMMITTED, transfer_id);
  v1::ItemResult released = decode.Release(transfer_id, commit.generation());  // only after TRANSFER_COMMITTED
  Expect(released.state() == v1::TRANSFER_STATE_RELEASED, "ReleaseTargets: RELEASED");
  Ok("push lifecycle: TARGETED, MATCHED, TRANSFER_ASSIGNED(" + std::to_string(assigned.generation()) +
     "), COMMITTED, TRANSFER_COMMITTED, RELEASED");
}

// Layouts that disagree are not refused: the transfer aborts at match, both sides told why, nothing written.
void LayoutMismatch(Stub* stub, Engine& decode, Watch& decode_events, const std::string& suffix) {
  Engine fp16(stub, "cpp-prefill-fp16-" + suffix, v1::ENGINE_ROLE_PRODUCER, 10, "float16");
  fp16.Register();
  std::string transfer_id = "cpp-" + suffix + "-layout";
  decode.RegisterTargets(transfer_id, {1, 2});
  v1::ItemResult claimed = fp16.Claim(transfer_id);
  Expect(claimed.state() == v1::TRANSFER_STATE_ABORTED, "a claim across layouts: ABORTED");
  v1::Event aborted = decode_events.Next(v1::EVENT_TYPE_TRANSFER_ABORTED, transfer_id);
  Expect(aborted.transfer().abort_reason() == v1::ABORT_REASON_LAYOUT_MISMATCH, "abort reason LAYOUT_MISMATCH");
  fp16.Deregister();
  Ok("layout mismatch: TRANSFER_ABORTED(LAYOUT_MISMATCH): " + aborted.transfer().abort_message());
}

void Refusals(Engine& decode, const std::string& transfer_id) {
  // An item refused: the call succeeds, the item's status holds the google.rpc.Status.
  v1::ItemResult out_of_range = decode.RegisterTargets(transfer_id, {64});
  std::string reason = KnownReason(ErrorInfoOf(out_of_range.status()));
  Expect(out_of_range.status().code() == grpc::StatusCode::OUT_OF_RANGE && reason == "BLOCK_ID_OUT_OF_RANGE",
         "a block beyond the registered regions: " + out_of_range.status().message());
  Ok("item refused: OUT_OF_RANGE / " + reason);
  // A call refused: its google.rpc.Status is in the trailer.
  grpc::Status stale = decode.RegisterTargetsAs(decode.incarnation() + 1, transfer_id);
  reason = KnownReason(ErrorInfoOf(stale));
  Expect(stale.error_code() == grpc::StatusCode::FAILED_PRECONDITION && reason == "STALE_INCARNATION",
         "a call with another incarnation: " + stale.error_message());
  Ok("call refused: FAILED_PRECONDITION / " + reason);
}

// A consumer whose lease lapses: its producer is told (TRANSFER_ABORTED with PEER_LOST, then PEER_LOST), the
// consumer's next KeepAlive is refused LEASE_EXPIRED, and it registers again as a new incarnation.
void LeaseExpiry(Stub* stub, Engine& prefill, Watch& prefill_events, const std::string& suffix) {
  Engine lapsing(stub, "cpp-decode-lapsing-" + suffix, v1::ENGINE_ROLE_CONSUMER, 2);
  lapsing.Register();
  uint64_t first = lapsing.incarnation();
  std::string transfer_id = "cpp-" + suffix + "-lapse";
  Expect(lapsing.RegisterTargets(transfer_id, {1}).state() == v1::TRANSFER_STATE_TARGETED, "the lapsing target");
  Expect(prefill.Claim(transfer_id).state() == v1::TRANSFER_STATE_MATCHED, "ClaimTransfers of the lapsing target");
  // No KeepAlive for `lapsing`: its lease lapses within two seconds.
  v1::Event aborted = prefill_events.Next(v1::EVENT_TYPE_TRANSFER_ABORTED, transfer_id);
  Expect(aborted.transfer().abort_reason() == v1::ABORT_REASON_PEER_LOST && aborted.generation() == 0,
         "TRANSFER_ABORTED(PEER_LOST), generation 0");
  v1::Event lost = prefill_events.Next(v1::EVENT_TYPE_PEER_LOST);
  Expect(lost.peer().engine_id() == lapsing.id() && lost.peer().incarnation() == first, "PEER_LOST names it");

  grpc::ClientContext context;
  auto stream = stub->KeepAlive(&context);
  v1::KeepAliveRequest renewal;
  renewal.set_engine_id(lapsing.id());
  renewal.set_incarnation(first);
  v1::KeepAliveResponse response;
  stream->Write(renewal);
  Expect(!stream->Read(&response), "a lapsed lease is not renewed");
  grpc::Status status = stream->Finish();
  std::string reason = KnownReason(ErrorInfoOf(status));
  Expect(reason == "LEASE_EXPIRED", "KeepAlive after the lapse: " + status.error_message());

  lapsing.Register();  // a new incarnation; the old one's transfers were aborted
  Expect(lapsing.incarnation() != first, "a new incarnation");
  v1::ItemResult again = lapsing.RegisterTargets("cpp-" + suffix + "-after-lapse", {1});
  Expect(again.state() == v1::TRANSFER_STATE_TARGETED, "the new incarnation registers targets");
  lapsing.Deregister();
  Ok("lease expiry: producer told PEER_LOST, KeepAlive refused " + reason + ", registered again as incarnation " +
     std::to_string(lapsing.incarnation()));
}

// Whoever runs the client with a proxy or several replicas (tests/cpp does) does to them what the client asks: it
// prints "proxy: cut", "proxy: restore", "proxy: freeze", "proxy: thaw" or "replica: stop ADDRESS" and reads the same
// line back once that is done.
void Ask(const std::string& what) {
  std::cout << what << std::endl;
  std::string done;
  Expect(std::getline(std::cin, done) && done == what, "the answer to " + what);
}

void AskTheProxy(const std::string& what) { Ask("proxy: " + what); }

// The producer's part of a push transfer a consumer targeted and it claimed: it writes and reports.
void Commit(Engine& prefill, Watch& prefill_events, const std::string& transfer_id) {
  v1::Event assigned = prefill_events.Next(v1::EVENT_TYPE_TRANSFER_ASSIGNED, transfer_id);
  Expect(prefill.Complete(transfer_id, assigned.generation()).state() == v1::TRANSFER_STATE_COMMITTED,
         "CompleteTransfers " + transfer_id + ": COMMITTED");
}

// A consumer whose connection drops mid-life (it talks through a proxy that cuts it, then lets it through again).
// Its lease outlives the outage and the events sent to it wait in the server's log: KeepAlive and Watch are
// reopened at once (they wait for the connection), the lease renewed as the same incarnation, the Watch resumed
// from the last sequence seen + 1. An outage longer than the log (the server keeps `events_kept` events per
// engine) gets resync_required: ListTransfers, rebuild, go on from resync_sequence.
void ConnectionDrop(Stub* through_proxy, Engine& prefill, Watch& prefill_events, const std::string& suffix,
                    int events_kept) {
  Engine dropping(through_proxy, "cpp-decode-dropping-" + suffix, v1::ENGINE_ROLE_CONSUMER, 10);
  dropping.Register();
  auto produce = [&](const std::string& transfer_id) {  // the producer is not cut off
    Commit(prefill, prefill_events, transfer_id);
  };
  auto target = [&](const std::string& transfer_id, int64_t block) {
    Expect(dropping.RegisterTargets(transfer_id, {block}).state() == v1::TRANSFER_STATE_TARGETED, "TARGETED");
    Expect(prefill.Claim(transfer_id).state() == v1::TRANSFER_STATE_MATCHED, "MATCHED");
  };
  {
    std::vector<std::string> rebuilt;
    Lease lease(dropping);
    Watch events(dropping, [&] {
      // What the lost events said is in the listing: a transfer committed to us is ours to read and release.
      // (One that ended while we were away, RELEASED or ABORTED, is not listed: GetTransfer tells which.)
      for (const v1::Transfer& transfer : dropping.Transfers(v1::TRANSFER_STATE_COMMITTED)) {
        Expect(dropping.Release(transfer.transfer_id(), transfer.generation()).state() == v1::TRANSFER_STATE_RELEASED,
               "ReleaseTargets after the resync: RELEASED");
        rebuilt.push_back(transfer.transfer_id());
      }
    });
    lease.AwaitRenewal(1);
    std::string before = "cpp-" + suffix + "-before-drop", during = "cpp-" + suffix + "-drop";
    target(before, 1);
    produce(before);  // an event seen before the drop
    v1::Event seen = events.Next(v1::EVENT_TYPE_TRANSFER_COMMITTED, before);
    Expect(dropping.Release(before, seen.generation()).state() == v1::TRANSFER_STATE_RELEASED, "RELEASED");

    // An outage the log covers: the commit made while the consumer is away comes once, when its Watch resumes.
    target(during, 2);
    AskTheProxy("cut");
    produce(during);
    AskTheProxy("restore");
    v1::Event commit = events.Next(v1::EVENT_TYPE_TRANSFER_COMMITTED, during);
    uint64_t resumed_at = events.AwaitOpened(2).resumed_at;
    Expect(commit.sequence() == seen.sequence() + 1 && commit.sequence() == resumed_at,
           "the commit made while away is the first event of the resumed Watch");
    Expect(dropping.Release(during, commit.generation()).state() == v1::TRANSFER_STATE_RELEASED, "RELEASED");
    lease.AwaitRenewal(2);  // renewed on a reopened stream: the same incarnation, its lease kept
    Ok("connection dropped: Watch resumed at sequence " + std::to_string(resumed_at) +
       " with the TRANSFER_COMMITTED made while away, once; KeepAlive reopened, incarnation " +
       std::to_string(dropping.incarnation()) + " renewed");

    // An outage longer than the log: more events are made for the consumer than the server keeps.
    std::vector<std::string> committed;
    for (int i = 0; i <= events_kept; ++i) {
      committed.push_back("cpp-" + suffix + "-resync-" + std::to_string(i));
      target(committed.back(), i % 64);
    }
    AskTheProxy("cut");
    for (const std::string& transfer_id : committed) produce(transfer_id);
    AskTheProxy("restore");
    uint64_t resync_sequence = events.AwaitResync(1);
    std::sort(rebuilt.begin(), rebuilt.end());
    std::sort(committed.begin(), committed.end());
    Expect(rebuilt == committed, "the rebuild finds every transfer committed while away");
    std::string after = "cpp-" + suffix + "-after-resync";
    target(after, 3);
    produce(after);
    commit = events.Next(v1::EVENT_TYPE_TRANSFER_COMMITTED, after);
    Expect(commit.sequence() == resync_sequence, "the Watch goes on from resync_sequence");
    Expect(dropping.Release(after, commit.generation()).state() == v1::TRANSFER_STATE_RELEASED, "RELEASED");
    Ok("resync: " + std::to_string(committed.size()) + " commits made while away, past the " +
       std::to_string(events_kept) + " events the server keeps; ListTransfers found them all, Watch went on at " +
       std::to_string(resync_sequence));
  }
  dropping.Deregister();
}

std::string Seconds(std::chrono::steady_clock::duration duration) {
  int tenths = std::chrono::duration_cast<std::chrono::milliseconds>(duration).count() / 100;
  return std::to_string(tenths / 10) + "." + std::to_string(tenths % 10) + " s";
}

// A consumer whose connection goes silent: the proxy it talks through stops forwarding and closes nothing (a peer or
// network lost without a reset). Nothing fails then by itself: a blocked Read waits for an answer that never comes,
// past the lease. The keepalive pings find it (Connect): the connection is given up, its streams fail UNAVAILABLE and
// reopen on a new one, as after a drop. The lease leaves the pings room on a busy machine (they take `time` +
// `timeout`; renewals come every third of the lease); the renewal answered on the reopened stream shows it was still
// held: a lapsed one is refused LEASE_EXPIRED.
void ConnectionSilent(Stub* through_proxy, Engine& prefill, Watch& prefill_events, const std::string& suffix,
                      KeepAlivePings pings) {
  int lease_seconds = 4 * std::chrono::duration_cast<std::chrono::seconds>(pings.time + pings.timeout).count();
  Engine silent(through_proxy, "cpp-decode-silent-" + suffix, v1::ENGINE_ROLE_CONSUMER, lease_seconds);
  silent.Register();
  {
    Lease lease(silent);
    Watch events(silent);
    lease.AwaitRenewal(1);
    std::string transfer_id = "cpp-" + suffix + "-silent";
    Expect(silent.RegisterTargets(transfer_id, {1}).state() == v1::TRANSFER_STATE_TARGETED, "TARGETED");
    Expect(prefill.Claim(transfer_id).state() == v1::TRANSFER_STATE_MATCHED, "MATCHED");
    AskTheProxy("freeze");  // no byte goes through, nothing is closed; new connections wait
    auto frozen = std::chrono::steady_clock::now();
    Commit(prefill, prefill_events, transfer_id);
    AskTheProxy("thaw");  // new connections go through; the frozen one stays silent
    v1::Event commit = events.Next(v1::EVENT_TYPE_TRANSFER_COMMITTED, transfer_id);
    auto found = std::chrono::steady_clock::now() - frozen;
    uint64_t resumed_at = events.AwaitOpened(2).resumed_at;
    Expect(commit.sequence() == resumed_at, "the commit made while silent is the first event of the resumed Watch");
    lease.AwaitRenewal(2);  // renewed on the new connection: the same incarnation, its lease kept
    Expect(silent.Release(transfer_id, commit.generation()).state() == v1::TRANSFER_STATE_RELEASED, "RELEASED");
    Ok("silent connection: found by the keepalive pings, Watch resumed on a new connection " + Seconds(found) +
       " after the silence began, at sequence " + std::to_string(resumed_at) +
       " with the TRANSFER_COMMITTED made meanwhile; KeepAlive renewed there within the " +
       std::to_string(lease_seconds) + " s lease");
  }
  silent.Deregister();
}

// Several replicas of the service on one store, the engines' channel naming them all (Connect): the replica they
// talk to stops (gracefully: it ends their streams). The channel goes on to another, where KeepAlive and Watch reopen
// as after a drop: the same incarnations renewed, the Watch resumed from the last sequence seen + 1 (the lease and
// the events are the store's, not the replica's; Watch checks that no event is lost or repeated).
void ReplicaFailover(Engine& decode, Engine& prefill, Lease& decode_lease, Lease& prefill_lease, Watch& decode_events,
                     Watch& prefill_events, const std::string& suffix) {
  std::string stopped = decode_lease.AwaitRenewal(1);
  Ask("replica: stop " + stopped);
  std::string transfer_id = "cpp-" + suffix + "-failover";
  Expect(decode.RegisterTargets(transfer_id, {4}).state() == v1::TRANSFER_STATE_TARGETED, "TARGETED");
  Expect(prefill.Claim(transfer_id).state() == v1::TRANSFER_STATE_MATCHED, "MATCHED");
  Commit(prefill, prefill_events, transfer_id);
  v1::Event commit = decode_events.Next(v1::EVENT_TYPE_TRANSFER_COMMITTED, transfer_id);
  Expect(decode.Release(transfer_id, commit.generation()).state() == v1::TRANSFER_STATE_RELEASED, "RELEASED");
  Watch::Opening resumed = decode_events.AwaitOpened(2);
  std::string decode_renewed = decode_lease.AwaitRenewal(2), prefill_renewed = prefill_lease.AwaitRenewal(2);
  Expect(resumed.peer != stopped && prefill_events.AwaitOpened(2).peer != stopped, "Watch reopened on another replica");
  Expect(decode_renewed != stopped && prefill_renewed != stopped, "KeepAlive renewed on another replica");
  Ok("replica stopped: " + stopped + "; KeepAlive renewed (incarnations " + std::to_string(decode.incarnation()) +
     ", " + std::to_string(prefill.incarnation()) + ") and Watch resumed at sequence " +
     std::to_string(resumed.resumed_at) + " on " + resumed.peer + ", a transfer run through it");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  KeepAlivePings pings;
  if (args.size() >= 2 && args[args.size() - 2] == "--keepalive") {
    const std::string& times = args.back();  // TIME_MS,TIMEOUT_MS
    pings = {std::chrono::milliseconds(std::stoi(times)),
             std::chrono::milliseconds(std::stoi(times.substr(times.find(',') + 1)))};
    args.resize(args.size() - 2);
  }
  if (args.size() != 1 && args.size() != 3) {
    std::cerr << "usage: " << argv[0] << " TARGET [PROXY_HOST:PORT EVENTS_KEPT] [--keepalive TIME_MS,TIMEOUT_MS]"
              << std::endl;
    return 2;
  }
  const std::string& target = args[0];
  std::unique_ptr<Stub> stub = v1::RendezvousService::NewStub(Connect(target, pings));
  std::string suffix = std::to_string(getpid());

  Engine decode(stub.get(), "cpp-decode-" + suffix, v1::ENGINE_ROLE_CONSUMER, 10);
  Engine prefill(stub.get(), "cpp-prefill-" + suffix, v1::ENGINE_ROLE_PRODUCER, 10);
  decode.Register();
  prefill.Register();
  Ok("registered a consumer (incarnation " + std::to_string(decode.incarnation()) + ") and a producer");
  {
    Lease decode_lease(decode), prefill_lease(prefill);
    Watch decode_events(decode), prefill_events(prefill);
    PushLifecycle(decode, prefill, decode_events, prefill_events, "cpp-" + suffix + "-1");
    Refusals(decode, "cpp-" + suffix + "-2");
    LayoutMismatch(stub.get(), decode, decode_events, suffix);
    LeaseExpiry(stub.get(), prefill, prefill_events, suffix);
    if (args.size() == 3) {
      std::unique_ptr<Stub> through_proxy = v1::RendezvousService::NewStub(Connect(args[1], pings));
      ConnectionDrop(through_proxy.get(), prefill, prefill_events, suffix, std::stoi(args[2]));
      ConnectionSilent(through_proxy.get(), prefill, prefill_events, suffix, pings);
    }
    if (target.find(',') != std::string::npos)
      ReplicaFailover(decode, prefill, decode_lease, prefill_lease, decode_events, prefill_events, suffix);
  }
  decode.Deregister();
  prefill.Deregister();
  Ok("deregistered");
  return 0;
}
