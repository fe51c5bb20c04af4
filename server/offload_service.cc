#include "server/offload_service.h"

namespace stallfree {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Finishes the reactor, counting an error by method and code (the metrics' rejections).
void OffloadService::Finish(grpc::ServerUnaryReactor* r, const char* method,
                            const absl::Status& s) {
  if (!s.ok()) sessions_->counters().rejections.Add(method, static_cast<int>(s.code()));
  r->Finish(ToGrpc(s));
}

std::function<void(absl::Status)> OffloadService::Finisher(grpc::ServerUnaryReactor* r,
                                                           const char* method) {
  return [this, r, method](absl::Status s) { Finish(r, method, s); };
}

grpc::ServerUnaryReactor* OffloadService::OpenSession(grpc::CallbackServerContext* ctx,
                                                      const v1::OpenSessionRequest* req,
                                                      v1::OpenSessionResponse* resp) {
  auto* r = ctx->DefaultReactor();
  auto out = sessions_->Open(*req);
  if (out.ok()) *resp = std::move(*out);
  Finish(r, "OpenSession", out.status());
  return r;
}

grpc::ServerUnaryReactor* OffloadService::CloseSession(grpc::CallbackServerContext* ctx,
                                                       const v1::CloseSessionRequest* req,
                                                       v1::CloseSessionResponse* resp) {
  auto* r = ctx->DefaultReactor();
  auto out = sessions_->Close(*req);
  if (out.ok()) resp->set_freed_bytes(*out);
  Finish(r, "CloseSession", out.status());
  return r;
}

grpc::ServerUnaryReactor* OffloadService::RegisterParams(grpc::CallbackServerContext* ctx,
                                                         const v1::RegisterParamsRequest* req,
                                                         v1::RegisterParamsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->RegisterParams(*req, resp, Finisher(r, "RegisterParams"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::LoadParams(grpc::CallbackServerContext* ctx,
                                                     const v1::LoadParamsRequest* req,
                                                     v1::LoadParamsResponse*) {
  auto* r = ctx->DefaultReactor();
  sessions_->LoadParams(*req, Finisher(r, "LoadParams"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::PushGradients(grpc::CallbackServerContext* ctx,
                                                        const v1::PushGradientsRequest* req,
                                                        v1::PushGradientsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->PushGradients(*req, resp, Finisher(r, "PushGradients"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::PushGradientsInline(
    grpc::CallbackServerContext* ctx, const v1::PushGradientsInlineRequest* req,
    v1::PushGradientsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->PushGradientsInline(*req, resp, Finisher(r, "PushGradientsInline"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::Update(grpc::CallbackServerContext* ctx,
                                                 const v1::UpdateRequest* req,
                                                 v1::UpdateResponse* resp) {
  auto* r = ctx->DefaultReactor();
  absl::Status st = sessions_->Update(*req);
  if (st.ok()) resp->set_version(req->step());
  Finish(r, "Update", st);
  return r;
}

grpc::ServerUnaryReactor* OffloadService::WaitUpdate(grpc::CallbackServerContext* ctx,
                                                     const v1::WaitUpdateRequest* req,
                                                     v1::WaitUpdateResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->WaitUpdate(*req, [this, r, resp](absl::StatusOr<WaitResult> res) {
    if (res.ok()) {
      resp->set_version(res->version);
      resp->set_param_slot(res->slot);
      resp->set_dtype(res->dtype);
      resp->set_update_seconds(res->update_seconds);
    }
    Finish(r, "WaitUpdate", res.status());
  });
  return r;
}

grpc::ServerUnaryReactor* OffloadService::MigrateColumns(grpc::CallbackServerContext* ctx,
                                                         const v1::MigrateColumnsRequest* req,
                                                         v1::MigrateColumnsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->MigrateColumns(*req, resp, Finisher(r, "MigrateColumns"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::Checkpoint(grpc::CallbackServerContext* ctx,
                                                     const v1::CheckpointRequest* req,
                                                     v1::CheckpointResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->Checkpoint(*req, resp, Finisher(r, "Checkpoint"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::Restore(grpc::CallbackServerContext* ctx,
                                                  const v1::RestoreRequest* req,
                                                  v1::RestoreResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->Restore(*req, resp, Finisher(r, "Restore"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                          const v1::ListCheckpointsRequest* req,
                                                          v1::ListCheckpointsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->ListCheckpoints(*req, resp, Finisher(r, "ListCheckpoints"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::ReadCheckpoint(grpc::CallbackServerContext* ctx,
                                                         const v1::ReadCheckpointRequest* req,
                                                         v1::ReadCheckpointResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->ReadCheckpoint(*req, resp, Finisher(r, "ReadCheckpoint"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::WriteCheckpoint(grpc::CallbackServerContext* ctx,
                                                          const v1::WriteCheckpointRequest* req,
                                                          v1::WriteCheckpointResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->WriteCheckpoint(*req, resp, Finisher(r, "WriteCheckpoint"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                                           const v1::DeleteCheckpointRequest* req,
                                                           v1::DeleteCheckpointResponse*) {
  auto* r = ctx->DefaultReactor();
  sessions_->DeleteCheckpoint(*req, Finisher(r, "DeleteCheckpoint"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::ExportState(grpc::CallbackServerContext* ctx,
                                                      const v1::ExportStateRequest* req,
                                                      v1::ExportStateResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->ExportState(*req, resp, Finisher(r, "ExportState"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::ImportState(grpc::CallbackServerContext* ctx,
                                                      const v1::ImportStateRequest* req,
                                                      v1::ImportStateResponse* resp) {
  auto* r = ctx->DefaultReactor();
  sessions_->ImportState(*req, resp, Finisher(r, "ImportState"));
  return r;
}

grpc::ServerUnaryReactor* OffloadService::GetStats(grpc::CallbackServerContext* ctx,
                                                   const v1::GetStatsRequest*,
                                                   v1::GetStatsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  *resp->mutable_stats() = sessions_->GetStats();
  r->Finish(grpc::Status::OK);
  return r;
}

grpc::ServerUnaryReactor* OffloadService::ListSessions(grpc::CallbackServerContext* ctx,
                                                       const v1::ListSessionsRequest* req,
                                                       v1::ListSessionsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  auto out = sessions_->ListSessions(req->caller());
  if (out.ok())
    for (auto& s : *out) *resp->add_sessions() = std::move(s);
  Finish(r, "ListSessions", out.status());
  return r;
}

grpc::ServerUnaryReactor* OffloadService::GetMetrics(grpc::CallbackServerContext* ctx,
                                                     const v1::GetMetricsRequest* req,
                                                     v1::GetMetricsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  absl::Status st = sessions_->AuthorizeOperator(req->caller(), "GetMetrics");
  if (st.ok()) resp->set_text(metrics_());
  Finish(r, "GetMetrics", st);
  return r;
}

}  // namespace stallfree
