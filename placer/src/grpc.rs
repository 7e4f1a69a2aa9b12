//! The `Placer` gRPC service of `iadeep-proto` over a [`PlacementService`].

use iadeep_proto::placer_server::{Placer as PlacerRpc, PlacerServer};
use iadeep_proto::{
    ListDevicesRequest, ListDevicesResponse, PlaceRequest, PlaceResponse, ReleaseRequest,
    ReleaseResponse,
};
use tonic::{Request, Response, Status};

use crate::error::PlacerError;
use crate::service::PlacementService;

/// Maps placer errors to gRPC codes a client can act on.
pub fn status_of(err: &PlacerError) -> Status {
    match err {
        PlacerError::InvalidArgument { .. } => Status::invalid_argument(err.to_string()),
        PlacerError::AlreadyPlaced { .. } => Status::already_exists(err.to_string()),
        // Retrying later is the right reaction to both.
        PlacerError::Contention { .. } => Status::aborted(err.to_string()),
        PlacerError::Store(_) => Status::unavailable(err.to_string()),
        PlacerError::InvalidParams { .. }
        | PlacerError::Serve { .. }
        | PlacerError::Kubernetes { .. } => Status::internal(err.to_string()),
    }
}

/// "gpu0: reason; gpu1: reason", at most a few devices, for an error message.
pub fn never_fits_text(reasons: &[(String, crate::policy::Rejection)]) -> String {
    const SHOWN: usize = 3;
    let mut text: Vec<String> = reasons
        .iter()
        .take(SHOWN)
        .map(|(id, why)| format!("{id}: {why}"))
        .collect();
    if reasons.len() > SHOWN {
        text.push(format!("and {} more", reasons.len() - SHOWN));
    }
    text.join("; ")
}

/// The gRPC front end.
#[derive(Debug, Clone)]
pub struct GrpcPlacer {
    service: PlacementService,
}

impl GrpcPlacer {
    /// A tonic service answering with `service`.
    pub fn server(service: PlacementService) -> PlacerServer<GrpcPlacer> {
        PlacerServer::new(GrpcPlacer { service })
    }
}

#[tonic::async_trait]
impl PlacerRpc for GrpcPlacer {
    async fn place(
        &self,
        request: Request<PlaceRequest>,
    ) -> Result<Response<PlaceResponse>, Status> {
        let request = request.into_inner();
        let Some(task) = request.task else {
            self.service.metrics().invalid.inc();
            return Err(Status::invalid_argument(
                "invalid task: missing (a PlaceRequest must carry the TaskSpec to place)",
            ));
        };
        // Malformed requests are answered as such first (the same checks as the
        // service's), so the error names the field at fault.
        let checked = crate::validate::task_spec("task", &task).and_then(|()| {
            crate::validate::device_ids("candidate_device_ids", &request.candidate_device_ids)
        });
        if let Err(err) = checked {
            self.service.metrics().invalid.inc();
            return Err(status_of(&err));
        }
        if let Some(reasons) = self.service.placer().never_fits_any(
            &self.service.view(),
            &task,
            &request.candidate_device_ids,
        ) {
            // Never "queued": a client would retry forever, and the task would count as
            // waiting ahead of every later one.
            self.service.metrics().invalid.inc();
            return Err(Status::invalid_argument(format!(
                "invalid task: no device it may use can ever hold it ({})",
                never_fits_text(&reasons)
            )));
        }
        let outcome = self
            .service
            .place(task, request.candidate_device_ids)
            .await
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(PlaceResponse {
            decision: Some(outcome.decision),
            explanation: Some(outcome.explanation),
        }))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let request = request.into_inner();
        let device = self
            .service
            .release(&request.task_id)
            .await
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(ReleaseResponse {
            released: device.is_some(),
            device_id: device.unwrap_or_default(),
        }))
    }

    async fn list_devices(
        &self,
        _request: Request<ListDevicesRequest>,
    ) -> Result<Response<ListDevicesResponse>, Status> {
        Ok(Response::new(ListDevicesResponse {
            devices: self.service.list_devices(),
        }))
    }
}
