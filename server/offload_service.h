// OffloadService: the gRPC edge of stallfreed. Callback handlers validate through the
// SessionManager and finish their reactor when the work completes; none blocks a gRPC thread.
// absl::Status becomes grpc::Status here and nowhere else.
#pragma once

#include "server/session_manager.h"
#include "stallfree/v1/offload.grpc.pb.h"

namespace stallfree {

grpc::Status ToGrpc(const absl::Status& s);

class OffloadService final : public v1::Offload::CallbackService {
 public:
  // metrics: renders the Prometheus text (server/metrics.h) for GetMetrics.
  OffloadService(SessionManager* sessions, std::function<std::string()> metrics)
      : sessions_(sessions), metrics_(std::move(metrics)) {}

  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const v1::OpenSessionRequest* req,
                                        v1::OpenSessionResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterParams(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterParamsRequest* req,
                                           v1::RegisterParamsResponse* resp) override;
  grpc::ServerUnaryReactor* LoadParams(grpc::CallbackServerContext* ctx,
                                       const v1::LoadParamsRequest* req,
                                       v1::LoadParamsResponse* resp) override;
  grpc::ServerUnaryReactor* PushGradients(grpc::CallbackServerContext* ctx,
                                          const v1::PushGradientsRequest* req,
                                          v1::PushGradientsResponse* resp) override;
  grpc::ServerUnaryReactor* PushGradientsInline(grpc::CallbackServerContext* ctx,
                                                const v1::PushGradientsInlineRequest* req,
                                                v1::PushGradientsResponse* resp) override;
  grpc::ServerUnaryReactor* Update(grpc::CallbackServerContext* ctx, const v1::UpdateRequest* req,
                                   v1::UpdateResponse* resp) override;
  grpc::ServerUnaryReactor* WaitUpdate(grpc::CallbackServerContext* ctx,
                                       const v1::WaitUpdateRequest* req,
                                       v1::WaitUpdateResponse* resp) override;
  grpc::ServerUnaryReactor* MigrateColumns(grpc::CallbackServerContext* ctx,
                                           const v1::MigrateColumnsRequest* req,
                                           v1::MigrateColumnsResponse* resp) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* ctx,
                                       const v1::CheckpointRequest* req,
                                       v1::CheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* ctx,
                                    const v1::RestoreRequest* req,
                                    v1::RestoreResponse* resp) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* ctx,
                                            const v1::ListCheckpointsRequest* req,
                                            v1::ListCheckpointsResponse* resp) override;
  grpc::ServerUnaryReactor* ReadCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::ReadCheckpointRequest* req,
                                           v1::ReadCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* WriteCheckpoint(grpc::CallbackServerContext* ctx,
                                            const v1::WriteCheckpointRequest* req,
                                            v1::WriteCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                             const v1::DeleteCheckpointRequest* req,
                                             v1::DeleteCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* ExportState(grpc::CallbackServerContext* ctx,
                                        const v1::ExportStateRequest* req,
                                        v1::ExportStateResponse* resp) override;
  grpc::ServerUnaryReactor* ImportState(grpc::CallbackServerContext* ctx,
                                        const v1::ImportStateRequest* req,
                                        v1::ImportStateResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* req,
                                     v1::GetStatsResponse* resp) override;
  grpc::ServerUnaryReactor* GetMetrics(grpc::CallbackServerContext* ctx,
                                       const v1::GetMetricsRequest* req,
                                       v1::GetMetricsResponse* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;

 private:
  void Finish(grpc::ServerUnaryReactor* r, const char* method, const absl::Status& s);
  std::function<void(absl::Status)> Finisher(grpc::ServerUnaryReactor* r, const char* method);

  SessionManager* sessions_;
  std::function<std::string()> metrics_;
};

}  // namespace stallfree
