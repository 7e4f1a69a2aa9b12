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
        PlacerError::InvalidParams { .. } | PlacerError::Serve { .. } => {
            Status::internal(err.to_string())
        }
    }
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
