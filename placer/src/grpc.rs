//! The `Placer` gRPC service of `iadeep-proto` over a [`PlacementService`].

use iadeep_proto::placer_server::{Placer as PlacerRpc, PlacerServer};
use iadeep_proto::{
    ListDevicesRequest, ListDevicesResponse, PlaceRequest, PlaceResponse, ReleaseRequest,
    ReleaseResponse,
};
use tonic::{Request, Response, Status};

use iadeep_state::StateError;

use crate::error::PlacerError;
use crate::events::PlacementEvent;
use crate::service::PlacementService;
use crate::validate;

/// The trailer in which a server tells a client how long to wait before retrying, ms
/// (gRPC's retry design, gRFC A6, "pushback"): gRPC clients with a retry policy honour
/// it, and others can read it from the status's metadata.
pub const RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

/// The wait a status asks for in its [`RETRY_PUSHBACK_MS`] trailer, if it carries one
/// that reads as whole milliseconds: what a client of the placer reads back.
pub fn retry_pushback(status: &tonic::Status) -> Option<std::time::Duration> {
    status
        .metadata()
        .get(RETRY_PUSHBACK_MS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(std::time::Duration::from_millis)
}

/// Maps placer errors to gRPC codes a client can act on.
///
/// Only UNAVAILABLE invites a retry, so only what a retry can cure maps to it: no
/// store member reachable, and losing races to concurrent placements (nothing was
/// reserved; the answer carries when to come back in [`RETRY_PUSHBACK_MS`], as the
/// message does). Not ABORTED: gRPC's guide reserves it for a conflict the client must
/// resolve by redoing its own read-modify-write, and generic clients and retry policies
/// do not retry it, so clients could not tell it was worth asking again.
/// A stored value that does not decode is DATA_LOSS; a request the store refuses
/// as too large is RESOURCE_EXHAUSTED; any other store refusal is INTERNAL.
pub fn status_of(err: &PlacerError) -> Status {
    let message = err.to_string();
    match err {
        PlacerError::InvalidArgument { .. } => Status::invalid_argument(message),
        PlacerError::AlreadyPlaced { .. } => Status::already_exists(message),
        PlacerError::Contention { retry_after_ms, .. } => {
            let mut status = Status::unavailable(message);
            if let Ok(value) = retry_after_ms.to_string().parse() {
                status.metadata_mut().insert(RETRY_PUSHBACK_MS, value);
            }
            status
        }
        PlacerError::Store(store) => match store {
            StateError::Unavailable { .. } => Status::unavailable(message),
            StateError::Decode { .. } | StateError::Corrupt { .. } => Status::data_loss(message),
            StateError::Backend { reason, .. } if reason.contains("too large") => {
                Status::resource_exhausted(message)
            }
            _ => Status::internal(message),
        },
        PlacerError::InvalidParams { .. }
        | PlacerError::Serve { .. }
        | PlacerError::Kubernetes { .. } => Status::internal(message),
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
    /// A tonic service answering with `service`; requests larger than
    /// [`validate::MAX_REQUEST_BYTES`] are refused before they are decoded.
    pub fn server(service: PlacementService) -> PlacerServer<GrpcPlacer> {
        PlacerServer::new(GrpcPlacer { service })
            .max_decoding_message_size(validate::MAX_REQUEST_BYTES)
    }

    /// Refuses an invalid request (counted as such) before the service sees it.
    fn check(&self, checked: crate::error::Result<()>) -> Result<(), Status> {
        checked.map_err(|err| {
            self.service.record(PlacementEvent::Invalid);
            status_of(&err)
        })
    }
}

#[tonic::async_trait]
impl PlacerRpc for GrpcPlacer {
    async fn place(
        &self,
        request: Request<PlaceRequest>,
    ) -> Result<Response<PlaceResponse>, Status> {
        let request = request.into_inner();
        self.check(validate::place_request(&request))?;
        let Some(task) = request.task else {
            return Err(status_of(&PlacerError::invalid("task", "missing")));
        };
        if let Some(reasons) = self.service.placer().never_fits_any(
            &self.service.view(),
            &task,
            &request.candidate_device_ids,
        ) {
            // Never "queued": a client would retry forever, and the task would count as
            // waiting ahead of every later one.
            self.service.record(PlacementEvent::Invalid);
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
        self.check(validate::release_request(&request))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_is_unavailable_with_when_to_retry() {
        let err = PlacerError::contention("job-7", 3, 12);
        let PlacerError::Contention { retry_after_ms, .. } = &err else {
            unreachable!("contention() builds Contention");
        };
        let status = status_of(&err);
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert_eq!(
            retry_pushback(&status),
            Some(std::time::Duration::from_millis(*retry_after_ms))
        );
        assert!(
            status
                .message()
                .contains("3 reservation attempts lost, 12 waits"),
            "{}",
            status.message()
        );
    }
}
