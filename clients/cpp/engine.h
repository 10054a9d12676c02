// The pieces of a C++ engine's control plane that rendezvous_client.cc walks through, as docs/engines.md describes
// them: the channel (Connect, its keepalive pings and replicas), an engine's registration and batched calls (Engine),
// its lease kept alive over KeepAlive (Lease), its events followed over Watch (Watch), and a refusal's ErrorInfo
// (ErrorInfoOf, KnownReason). A walkthrough's, not a library's: whatever goes wrong ends the process (Fail).

#pragma once

#include <grpcpp/grpcpp.h>
#include <unistd.h>

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

namespace rendezvous_engine {

namespace v1 = rendezvous::v1;
using Stub = v1::RendezvousService::Stub;
using Clock = std::chrono::system_clock;

[[noreturn]] inline void Fail(const std::string& what) {
  std::cout << "FAILED " << what << std::endl;
  std::exit(1);
}

inline void Ok(const std::string& what) { std::cout << "ok " << what << std::endl; }

inline void Expect(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

// The ErrorInfo among a google.rpc.Status's details (packed as google.protobuf.Any).
inline std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const google::rpc::Status& status) {
  for (const auto& detail : status.details()) {
    google::rpc::ErrorInfo info;
    if (detail.Is<google::rpc::ErrorInfo>() && detail.UnpackTo(&info)) return info;
  }
  return std::nullopt;
}

// A refused call's google.rpc.Status comes in the trailer grpc-status-details-bin: error_details() holds it.
inline std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const grpc::Status& status) {
  google::rpc::Status rich;
  if (!rich.ParseFromString(status.error_details())) return std::nullopt;
  return ErrorInfoOf(rich);
}

// The ErrorInfo domain of the service's reasons, as errors.proto states it (ErrorReason's error_domain option).
inline const std::string& ErrorDomain() {
  static const std::string domain = v1::ErrorReason_descriptor()->options().GetExtension(v1::error_domain);
  return domain;
}

// The reason as the generated ErrorReason enum knows it ("" for an unknown one: act on the code then).
inline std::string KnownReason(const std::optional<google::rpc::ErrorInfo>& info) {
  v1::ErrorReason reason;
  if (!info || info->domain() != ErrorDomain() || !v1::ErrorReason_Parse("ERROR_REASON_" + info->reason(), &reason))
    return "";
  return info->reason();
}

inline std::unique_ptr<grpc::ClientContext> Deadline(int seconds = 10) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(Clock::now() + std::chrono::seconds(seconds));
  return context;
}

inline std::string RequestId() {  // AIP-155: a retry with the same id gets the first answer
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

// HTTP/2 keepalive pings: every `time` without a byte from the server, the channel pings it, and gives the connection
// up if the ping is unanswered within `timeout`.
struct KeepAlivePings {
  std::chrono::milliseconds time{30000};  // the Python SDK's (clients/_config.py KeepAliveConfig)
  std::chrono::milliseconds timeout{10000};
};

// One channel for every engine of the process. Several replicas of the service (one store) go in one target: gRPC's
// ipv4:IP:PORT,IP:PORT (ipv6:[IP]:PORT,... alike), or a dns:/// name that resolves to every replica. Its default
// policy, pick_first, keeps one connection, to the first address that takes it; once that connection is gone (the
// replica stopped, or the keepalive pings found it silent), the next call or reopened stream goes down the list
// again. Lease and Watch need nothing more: they reopen, waiting for the connection, on whichever replica answers.
// Copy this rather than rotate channels by hand (as the Python SDK does with its list of endpoints), unless one
// target cannot name the replicas: host names that do not resolve together, a TLS name of its own per replica.
inline std::shared_ptr<grpc::Channel> Connect(const std::string& target, KeepAlivePings pings) {
  grpc::ChannelArguments args;
  // Back soon after the connection is: reconnection attempts at most a second apart (gRPC's default backoff grows
  // to two minutes, far past a lease).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A connection gone silent is found only by pinging it: time + timeout must fit in the lease with room to renew
  // (rendezvous_client.cc, ConnectionSilent). The server takes a ping every 5 s at most while it sends nothing (it
  // closes a connection pinged more often with GOAWAY too_many_pings), so keep `time` at 5 s or more.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, pings.time.count());
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, pings.timeout.count());
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // ping however long the engine sends nothing
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

}  // namespace rendezvous_engine
