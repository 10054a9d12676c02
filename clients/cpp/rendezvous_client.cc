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
//     of the service on one store as ipv4:IP:PORT,IP:PORT (Connect): the caller then stops the replica the engines
//     talk to when asked (Ask). PROXY_HOST:PORT: a TCP proxy to the service that the caller cuts, freezes and lets
//     through again when asked; EVENTS_KEPT: the server's --max-events-per-engine, which a step overruns to provoke
//     a resync. --keepalive: the channels' HTTP/2 keepalive pings (default 30000,10000).

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "rendezvous/v1/errors.pb.h"
#include "rendezvous/v1/rendezvous.grpc.pb.h"

namespace v1 = rendezvous::v1;
using Stub = v1::RendezvousService::Stub;
using Clock = std::chrono::system_clock;

namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::cout << "FAILED " << what << std::endl;
  std::exit(1);
}

void Ok(const std::string& what) { std::cout << "ok " << what << std::endl; }

void Expect(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

// The ErrorInfo among a google.rpc.Status's details (packed as google.protobuf.Any).
std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const google::rpc::Status& status) {
  for (const auto& detail : status.details()) {
    google::rpc::ErrorInfo info;
    if (detail.Is<google::rpc::ErrorInfo>() && detail.UnpackTo(&info)) return info;
  }
  return std::nullopt;
}

// A refused call's google.rpc.Status comes in the trailer grpc-status-details-bin: error_details() holds it.
std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const grpc::Status& status) {
  google::rpc::Status rich;
  if (!rich.ParseFromString(status.error_details())) return std::nullopt;
  return ErrorInfoOf(rich);
}

// The ErrorInfo domain of the service's reasons, as errors.proto states it (ErrorReason's error_domain option).
const std::string& ErrorDomain() {
  static const std::string domain = v1::ErrorReason_descriptor()->options().GetExtension(v1::error_domain);
  return domain;
}

// The reason as the generated ErrorReason enum knows it ("" for an unknown one: act on the code then).
std::string KnownReason(const std::optional<google::rpc::ErrorInfo>& info) {
  v1::ErrorReason reason;
  if (!info || info->domain() != ErrorDomain() || !v1::ErrorReason_Parse("ERROR_REASON_" + info->reason(), &reason))
    return "";
  return info->reason();
}

std::unique_ptr<grpc::ClientContext> Deadline(int seconds = 10) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(Clock::now() + std::chrono::seconds(seconds));
  return context;
}

std::string RequestId() {  // AIP-155: a retry with the same id gets the first answer
  static std::atomic<int> next = 0;
  return "cpp-" + std::to_string(getpid()) + "-" + std::to_string(++next);
}

// One engine: its registration and the batched transfer calls it makes (one item each, here).
class Engine {
 public:
  Engine(Stub* stub, std::string id, v1::EngineRole role, int lease_seconds, std::string dtype = "bfloat16")
      : stub_(stub), id_(std::move(id)), role_(role), lease_seconds_(lease_seconds), dtype_(std::move(dtype)) {}

  void Register() {
    v1::RegisterEngineRequest request;
    request.set_request_id(RequestId());
    request.set_engine_id(id_);
    request.set_pool(role_ == v1::ENGINE_ROLE_CONSUMER ? "cpp-decode" : "cpp-prefill");
    request.set_role(role_);
    v1::KvLayout* layout = request.mutable_layout();  // state every field: the service compares them at match
    layout->set_model_fingerprint("cpp-example-model");
    layout->set_dtype(dtype_);
    layout->set_block_size(16);
    layout->set_num_layers(2);
    layout->set_tp_size(1);
    layout->set_pp_size(1);
    layout->set_kv_layout("HND");
    layout->set_num_kv_heads(8);
    layout->set_data_plane_version(4);  // the notification format a real data plane sends: "4 T:g"
    v1::NixlAgent* agent = request.add_agents();  // a stand-in: real engines send get_agent_metadata()
    agent->set_name(id_ + "-rank0");
    agent->set_metadata("md-" + id_);
    agent->set_memory_kind(v1::MEMORY_KIND_DRAM);
    v1::KvRegion* region = agent->add_regions();
    region->set_base_address(1 << 20);
    region->set_block_stride_bytes(4096);
    region->set_block_length_bytes(4096);
    region->set_num_blocks(64);
    request.mutable_lease_ttl()->set_seconds(lease_seconds_);
    v1::RegisterEngineResponse response;
    grpc::Status status = stub_->RegisterEngine(Deadline().get(), request, &response);
    Expect(status.ok(), "RegisterEngine " + id_ + ": " + status.error_message());
    incarnation_ = response.engine().incarnation();
    watch_start_ = response.watch_start_sequence();
  }

  v1::ItemResult RegisterTargets(const std::string& transfer_id, const std::vector<int64_t>& blocks) {
    v1::RegisterTargetsRequest request;
    Header(&request);
    v1::TargetSpec* target = request.add_targets();
    target->set_transfer_id(transfer_id);
    target->set_generation(1);
    for (int64_t block : blocks) target->add_block_ids(block);
    return Call<v1::RegisterTargetsResponse>("RegisterTargets", &Stub::RegisterTargets, request);
  }

  v1::ItemResult Claim(const std::string& transfer_id) {
    v1::ClaimTransfersRequest request;
    Header(&request);
    request.add_claims()->set_transfer_id(transfer_id);
    return Call<v1::ClaimTransfersResponse>("ClaimTransfers", &Stub::ClaimTransfers, request);
  }

  v1::ItemResult Complete(const std::string& transfer_id, uint64_t generation) {
    v1::CompleteTransfersRequest request;
    Header(&request);
    v1::CompletionSpec* completion = request.add_completions();
    completion->set_transfer_id(transfer_id);
    completion->set_generation(generation);
    completion->set_outcome(v1::COMPLETION_OUTCOME_SUCCEEDED);
    return Call<v1::CompleteTransfersResponse>("CompleteTransfers", &Stub::CompleteTransfers, request);
  }

  v1::ItemResult Release(const std::string& transfer_id, uint64_t generation) {
    v1::ReleaseTargetsRequest request;
    Header(&request);
    v1::ReleaseSpec* release = request.add_releases();
    release->set_transfer_id(transfer_id);
    release->set_generation(generation);
    return Call<v1::ReleaseTargetsResponse>("ReleaseTargets", &Stub::ReleaseTargets, request);
  }

  // The engine's transfers in `state`, every page of the listing (AIP-158: follow the token, never count).
  std::vector<v1::Transfer> Transfers(v1::TransferState state) {
    std::vector<v1::Transfer> transfers;
    v1::ListTransfersRequest request;
    request.set_engine_id(id_);
    request.add_states(state);
    do {
      v1::ListTransfersResponse response;
      grpc::Status status = stub_->ListTransfers(Deadline().get(), request, &response);
      Expect(status.ok(), "ListTransfers " + id_ + ": " + status.error_message());
      transfers.insert(transfers.end(), response.transfers().begin(), response.transfers().end());
      request.set_page_token(response.next_page_token());
    } while (!request.page_token().empty());
    return transfers;
  }

  // The same call as a zombie would make it: with an incarnation that is not the engine's.
  grpc::Status RegisterTargetsAs(uint64_t incarnation, const std::string& transfer_id) {
    v1::RegisterTargetsRequest request;
    Header(&request);
    request.set_incarnation(incarnation);
    request.add_targets()->set_transfer_id(transfer_id);
    v1::RegisterTargetsResponse response;
    return stub_->RegisterTargets(Deadline().get(), request, &response);
  }

  void Deregister() {
    v1::DeregisterEngineRequest request;
    request.set_request_id(RequestId());
    request.set_engine_id(id_);
    request.set_incarnation(incarnation_);
    v1::DeregisterEngineResponse response;
    grpc::Status status = stub_->DeregisterEngine(Deadline().get(), request, &response);
    Expect(status.ok(), "DeregisterEngine " + id_ + ": " + status.error_message());
  }

  const std::string& id() const { return id_; }
  uint64_t incarnation() const { return incarnation_; }
  uint64_t watch_start() const { return watch_start_; }
  Stub* stub() const { return stub_; }

 private:
  template <typename Request>
  void Header(Request* request) const {
    request->set_request_id(RequestId());
    request->set_engine_id(id_);
    request->set_incarnation(incarnation_);  // a replaced incarnation is refused: STALE_INCARNATION
  }

  // One item's call: a refused call fails here; a refused item comes back in its ItemResult.status.
  template <typename Response, typename Request, typename Method>
  v1::ItemResult Call(const std::string& name, Method method, const Request& request) {
    Response response;
    grpc::Status status = (stub_->*method)(Deadline().get(), request, &response);
    Expect(status.ok(), name + " " + id_ + " refused: " + KnownReason(ErrorInfoOf(status)) + " " +
                            status.error_message());
    Expect(response.results_size() == 1, name + ": one result per item");
    return response.results(0);
  }

  Stub* stub_;
  std::string id_;
  v1::EngineRole role_;
  int lease_seconds_;
  std::string dtype_;
  uint64_t incarnation_ = 0;
  uint64_t watch_start_ = 0;
};

// The lease kept alive over a KeepAlive stream: one message every third of the granted TTL, in a thread. A stream
// that breaks (UNAVAILABLE: the connection dropped) or that the server ends without an error (status OK: a replica
// shutting down) is reopened at once, as the same incarnation: the lease is the server's, not the stream's.
class Lease {
 public:
  explicit Lease(const Engine& engine) : thread_([this, &engine] { Renew(engine); }) {}

  ~Lease() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      if (context_ != nullptr) context_->TryCancel();  // a stream waiting for its connection stops waiting
    }
    wake_.notify_all();
    thread_.join();
  }

  // Waits until a renewal is answered on KeepAlive stream `stream` (1: the first) or a later one; fails if none is
  // within a granted TTL, after which the lease would have lapsed. The address that answered the last renewal.
  std::string AwaitRenewal(int stream) {
    std::unique_lock<std::mutex> lock(mutex_);
    Expect(renewed_.wait_for(lock, ttl_, [&] { return stream_ >= stream; }),
           "no renewal on KeepAlive stream " + std::to_string(stream) + " within the lease");
    return peer_;
  }

 private:
  void Renew(const Engine& engine) {
    v1::KeepAliveRequest request;
    request.set_engine_id(engine.id());
    request.set_incarnation(engine.incarnation());
    for (int opened = 1;; ++opened) {
      grpc::ClientContext context;
      context.set_wait_for_ready(true);  // opened while the connection is down, it waits for the channel to be back
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) return;
        context_ = &context;
      }
      auto stream = engine.stub()->KeepAlive(&context);
      v1::KeepAliveResponse response;
      while (stream->Write(request) && stream->Read(&response)) {
        std::unique_lock<std::mutex> lock(mutex_);
        const auto& ttl = response.lease_ttl();
        ttl_ = std::chrono::milliseconds(ttl.seconds() * 1000 + ttl.nanos() / 1000000);
        stream_ = opened;
        peer_ = context.peer();
        renewed_.notify_all();
        if (wake_.wait_for(lock, ttl_ / 3, [this] { return stopping_; })) {
          lock.unlock();
          stream->WritesDone();
          break;
        }
      }
      grpc::Status status = stream->Finish();  // why it ended
      std::lock_guard<std::mutex> lock(mutex_);
      context_ = nullptr;
      if (stopping_) return;
      Expect(status.ok() || status.error_code() == grpc::StatusCode::UNAVAILABLE,
             "KeepAlive " + engine.id() + " ended: " + KnownReason(ErrorInfoOf(status)) + " " + status.error_message());
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, renewed_;
  bool stopping_ = false;
  grpc::ClientContext* context_ = nullptr;  // the open stream's, to cancel it
  std::chrono::milliseconds ttl_{10000};    // the TTL granted last
  int stream_ = 0;                          // the stream the last renewal was answered on
  std::string peer_;                        // and the address that answered it
  std::thread thread_;
};

// An engine's Watch stream, read in a thread for the engine's life from the sequence its registration gave. Every
// event must be the one after the last seen: a stream that breaks or that the server ends without an error is
// reopened at once from the last sequence seen + 1, so none is lost or repeated. `resync_required` (the server
// no longer holds that sequence: events were lost) calls `rebuild` and goes on from `resync_sequence`.
class Watch {
 public:
  using Rebuild = std::function<void()>;

  explicit Watch(const Engine& engine, Rebuild rebuild = nullptr)
      : engine_id_(engine.id()), last_(engine.watch_start() - 1), rebuild_(std::move(rebuild)),
        thread_([this, &engine] { Read(engine); }) {
    std::unique_lock<std::mutex> lock(mutex_);
    Await(lock, [this] { return opened_ > 0; }, "header");  // the first answer: the watch is established
  }

  ~Watch() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    thread_.join();
  }

  // The next event of `type` about `transfer_id` ("" = any transfer); events before it are passed over.
  v1::Event Next(v1::EventType type, const std::string& transfer_id = "") {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      Await(lock, [this] { return !pending_.empty(); }, v1::EventType_Name(type));
      v1::Event event = pending_.front();
      pending_.pop_front();
      if (event.type() == type && (transfer_id.empty() || event.transfer().transfer_id() == transfer_id))
        return event;
    }
  }

  struct Opening {
    uint64_t resumed_at;  // the sequence it started at
    std::string peer;     // the address that answered it
  };

  // Waits until the stream has been established `times` times (1: the first opening); the last opening.
  Opening AwaitOpened(int times) {
    std::unique_lock<std::mutex> lock(mutex_);
    Await(lock, [&] { return opened_ >= times; }, "opening " + std::to_string(times));
    return opening_;
  }

  // Waits until the `times`th resync is rebuilt; the resync_sequence the watch went on from.
  uint64_t AwaitResync(int times) {
    std::unique_lock<std::mutex> lock(mutex_);
    Await(lock, [&] { return resyncs_ >= times; }, "resync " + std::to_string(times));
    return resync_sequence_;
  }

 private:
  // The walkthrough's events come within milliseconds: a minute without is a failure, not a wait.
  template <typename Predicate>
  void Await(std::unique_lock<std::mutex>& lock, Predicate ready, const std::string& what) {
    Expect(arrived_.wait_for(lock, std::chrono::minutes(1), ready), "Watch " + engine_id_ + ": no " + what);
  }

  void Read(const Engine& engine) {
    while (true) {
      grpc::ClientContext context;
      context.set_wait_for_ready(true);
      v1::WatchRequest request;
      request.set_engine_id(engine_id_);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) return;
        context_ = &context;
        request.set_start_sequence(last_ + 1);  // resume after the last event seen
      }
      auto reader = engine.stub()->Watch(&context, request);
      v1::WatchResponse response;
      bool header = true;  // each opening is answered with a header first
      while (reader->Read(&response)) {
        if (response.resync_required()) {
          if (!rebuild_) Fail("Watch " + engine_id_ + ": resync required");
          rebuild_();  // outside the lock: it calls the service
        }
        std::lock_guard<std::mutex> lock(mutex_);
        if (header) {
          opening_ = {request.start_sequence(), context.peer()};
          ++opened_;
          header = false;
        }
        if (response.resync_required()) {
          resync_sequence_ = response.resync_sequence();
          last_ = resync_sequence_ - 1;
          ++resyncs_;
        }
        for (const auto& event : response.events()) {
          Expect(event.sequence() == last_ + 1, "Watch " + engine_id_ + ": event " + std::to_string(event.sequence()) +
                                                    " after " + std::to_string(last_) + ": lost or repeated");
          last_ = event.sequence();
          pending_.push_back(event);
        }
        arrived_.notify_all();
      }
      grpc::Status status = reader->Finish();
      std::lock_guard<std::mutex> lock(mutex_);
      context_ = nullptr;
      if (stopping_) return;
      Expect(status.ok() || status.error_code() == grpc::StatusCode::UNAVAILABLE,
             "Watch " + engine_id_ + " ended: " + KnownReason(ErrorInfoOf(status)) + " " + status.error_message());
    }
  }

  std::string engine_id_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  bool stopping_ = false;
  grpc::ClientContext* context_ = nullptr;  // the open stream's, to cancel it
  uint64_t last_;           // the last sequence seen
  Opening opening_{0, ""};  // the last opening
  uint64_t resync_sequence_ = 0;
  int opened_ = 0;
  int resyncs_ = 0;
  std::deque<v1::Event> pending_;
  Rebuild rebuild_;
  std::thread thread_;
};

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

// HTTP/2 keepalive pings: every `time` without a byte from the server, the channel pings it, and gives the connection
// up if the ping is unanswered within `timeout`.
struct KeepAlivePings {
  std::chrono::milliseconds time{30000};  // the Python SDK's (clients/_config.py KeepAliveConfig)
  std::chrono::milliseconds timeout{10000};
};

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

// One channel for every engine of the process. Several replicas of the service (one store) go in one target: gRPC's
// ipv4:IP:PORT,IP:PORT (ipv6:[IP]:PORT,... alike), or a dns:/// name that resolves to every replica. Its default
// policy, pick_first, keeps one connection, to the first address that takes it; once that connection is gone (the
// replica stopped, or the keepalive pings found it silent), the next call or reopened stream goes down the list
// again. Lease and Watch need nothing more: they reopen, waiting for the connection, on whichever replica answers.
// Copy this rather than rotate channels by hand (as the Python SDK does with its list of endpoints), unless one
// target cannot name the replicas: host names that do not resolve together, a TLS name of its own per replica.
std::shared_ptr<grpc::Channel> Connect(const std::string& target, KeepAlivePings pings) {
  grpc::ChannelArguments args;
  // Back soon after the connection is: reconnection attempts at most a second apart (gRPC's default backoff grows
  // to two minutes, far past a lease).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A connection gone silent is found only by pinging it: time + timeout must fit in the lease with room to renew
  // (ConnectionSilent). The server takes a ping every 5 s at most while it sends nothing (it closes a connection
  // pinged more often with GOAWAY too_many_pings), so keep `time` at 5 s or more.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, pings.time.count());
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, pings.timeout.count());
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // ping however long the engine sends nothing
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
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
