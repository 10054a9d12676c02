// A C++ engine's control plane against a running kv-rendezvous, step by step as docs/engines.md describes it:
// register a consumer and a producer (leases renewed over KeepAlive), run one push transfer through its
// lifecycle while following both engines' Watch streams, read the ErrorInfo of refused calls (an item's and a
// whole call's), see a pair whose layouts differ aborted at match, and survive a lease that lapses. The agents
// are stand-ins: no NIXL, so the producer reports the write without making it (docs/engines.md, "Testing").
//
//   rendezvous_client HOST:PORT      prints "ok ..." per step; exits 1 at the first step that goes wrong

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
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
  static int next = 0;
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

// The lease kept alive over a KeepAlive stream: one message every third of the granted TTL, in a thread.
class Lease {
 public:
  explicit Lease(const Engine& engine) : thread_([this, &engine] { Renew(engine); }) {}

  ~Lease() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

 private:
  void Renew(const Engine& engine) {
    grpc::ClientContext context;
    auto stream = engine.stub()->KeepAlive(&context);
    v1::KeepAliveRequest request;
    request.set_engine_id(engine.id());
    request.set_incarnation(engine.incarnation());
    v1::KeepAliveResponse response;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      if (!stream->Write(request) || !stream->Read(&response)) break;  // ended: Finish says why
      auto third = std::chrono::milliseconds(response.lease_ttl().seconds() * 1000 / 3 +
                                             response.lease_ttl().nanos() / 3000000);
      wake_.wait_for(lock, third, [this] { return stopping_; });
    }
    stream->WritesDone();
    grpc::Status status = stream->Finish();
    Expect(stopping_, "KeepAlive " + engine.id() + " ended: " + KnownReason(ErrorInfoOf(status)));
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

// An engine's Watch stream, read event by event from the sequence its registration gave.
class Watch {
 public:
  explicit Watch(const Engine& engine) : engine_id_(engine.id()) {
    context_.set_deadline(Clock::now() + std::chrono::seconds(60));
    v1::WatchRequest request;
    request.set_engine_id(engine.id());
    request.set_start_sequence(engine.watch_start());
    reader_ = engine.stub()->Watch(&context_, request);
  }

  ~Watch() {
    context_.TryCancel();
    reader_->Finish();
  }

  // The next event of `type` about `transfer_id` ("" = any transfer); events before it are passed over.
  v1::Event Next(v1::EventType type, const std::string& transfer_id = "") {
    while (true) {
      while (pending_.empty()) {
        v1::WatchResponse response;
        Expect(reader_->Read(&response), "Watch " + engine_id_ + " ended waiting for " + v1::EventType_Name(type));
        Expect(!response.resync_required(), "Watch " + engine_id_ + ": resync required");
        for (const auto& event : response.events()) pending_.push_back(event);  // the first has only a header
      }
      v1::Event event = pending_.front();
      pending_.pop_front();
      if (event.type() == type && (transfer_id.empty() || event.transfer().transfer_id() == transfer_id))
        return event;
    }
  }

 private:
  std::string engine_id_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::WatchResponse>> reader_;
  std::deque<v1::Event> pending_;
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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " HOST:PORT" << std::endl;
    return 2;
  }
  auto channel = grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials());
  std::unique_ptr<Stub> stub = v1::RendezvousService::NewStub(channel);
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
  }
  decode.Deregister();
  prefill.Deregister();
  Ok("deregistered");
  return 0;
}
