//! The etcd backend, for clusters of many machines.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};

use crate::error::{Result, StateError};
use crate::store::{
    Expect, KeyValue, LeaseId, RangeSnapshot, Revision, StateStore, TxnOutcome, WatchEvent,
    WatchStream, lease_ttl_secs,
};

/// How long connecting to an endpoint may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one unary request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// First and largest pause between attempts to re-establish a broken watch.
const WATCH_RETRY_MIN: Duration = Duration::from_millis(100);
const WATCH_RETRY_MAX: Duration = Duration::from_secs(2);

/// A [`StateStore`] on an etcd cluster (API v3).
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    endpoints: Vec<String>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// Connects to the cluster at `endpoints` (`host:port`) and checks that it answers,
    /// so a wrong address fails here with a clear message rather than at first use.
    pub async fn connect(endpoints: &[String]) -> Result<EtcdStore> {
        let joined = endpoints.join(",");
        let unavailable = |reason: String| StateError::Unavailable {
            endpoints: joined.clone(),
            reason,
        };
        if endpoints.is_empty() {
            return Err(unavailable("no endpoints given".into()));
        }
        let options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        let urls: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
        let client = tokio::time::timeout(CONNECT_TIMEOUT, Client::connect(&urls, Some(options)))
            .await
            .map_err(|_| unavailable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| unavailable(e.to_string()))?;
        let store = EtcdStore {
            client,
            endpoints: endpoints.to_vec(),
        };
        store.server_version().await?;
        Ok(store)
    }

    /// The version of the etcd server answering (e.g. `3.4.23`).
    pub async fn server_version(&self) -> Result<String> {
        let mut maintenance = self.client.maintenance_client();
        let status = tokio::time::timeout(CONNECT_TIMEOUT, maintenance.status())
            .await
            .map_err(|_| StateError::Unavailable {
                endpoints: self.endpoints.join(","),
                reason: format!("status request not answered within {CONNECT_TIMEOUT:?}"),
            })?
            .map_err(|e| self.error("status", "the cluster", e))?;
        Ok(status.version().to_owned())
    }

    fn error(&self, op: &'static str, target: &str, err: etcd_client::Error) -> StateError {
        let reason = err.to_string();
        let unreachable = match &err {
            etcd_client::Error::TransportError(_) => true,
            etcd_client::Error::GRpcStatus(status) => matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
            ),
            _ => false,
        };
        if unreachable {
            StateError::Unavailable {
                endpoints: self.endpoints.join(","),
                reason: format!("{op} on {target}: {reason}"),
            }
        } else {
            StateError::Backend {
                op,
                target: target.to_owned(),
                reason,
            }
        }
    }

    fn lease_error(&self, op: &'static str, lease: LeaseId, err: etcd_client::Error) -> StateError {
        if err.to_string().contains("lease not found") {
            StateError::LeaseNotFound(lease)
        } else {
            self.error(op, &format!("lease {lease}"), err)
        }
    }
}

fn convert_kv(kv: &etcd_client::KeyValue) -> Result<KeyValue> {
    let key = std::str::from_utf8(kv.key()).map_err(|_| StateError::Corrupt {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        reason: "key is not UTF-8".into(),
    })?;
    Ok(KeyValue {
        key: key.to_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: (kv.lease() != 0).then_some(LeaseId(kv.lease())),
    })
}

fn header_revision(header: Option<&etcd_client::ResponseHeader>) -> Revision {
    header.map_or(0, |h| h.revision())
}

fn convert_event(event: &etcd_client::Event) -> Result<Option<WatchEvent>> {
    let Some(kv) = event.kv() else {
        return Ok(None);
    };
    let kv = convert_kv(kv)?;
    Ok(Some(match event.event_type() {
        EventType::Put => WatchEvent::Put(kv),
        EventType::Delete => WatchEvent::Delete {
            key: kv.key,
            revision: kv.mod_revision,
        },
    }))
}

#[async_trait]
impl StateStore for EtcdStore {
    fn describe(&self) -> String {
        format!("etcd://{}", self.endpoints.join(","))
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let mut kv = self.client.kv_client();
        let resp = kv
            .get(key, None)
            .await
            .map_err(|e| self.error("get", key, e))?;
        resp.kvs().first().map(convert_kv).transpose()
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        let mut kv = self.client.kv_client();
        let options = lease.map(|l| PutOptions::new().with_lease(l.0));
        let resp = kv.put(key, value, options).await.map_err(|e| match lease {
            Some(l) if e.to_string().contains("lease not found") => StateError::LeaseNotFound(l),
            _ => self.error("put", key, e),
        })?;
        Ok(header_revision(resp.header()))
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        let mut kv = self.client.kv_client();
        let resp = kv
            .delete(key, None)
            .await
            .map_err(|e| self.error("delete", key, e))?;
        Ok(resp.deleted() > 0)
    }

    async fn transact(&self, txn: crate::store::Txn) -> Result<TxnOutcome> {
        // etcd would refuse it too, with a less helpful message.
        txn.check()?;
        let target = txn
            .ops
            .first()
            .map(|op| op.key().to_owned())
            .or_else(|| txn.compares.first().map(|c| c.key.clone()))
            .unwrap_or_else(|| "an empty transaction".to_owned());
        let lease = txn.ops.iter().find_map(|op| match op {
            crate::store::TxnOp::Put { lease, .. } => *lease,
            crate::store::TxnOp::Delete { .. } => None,
        });
        let compares: Vec<Compare> = txn
            .compares
            .iter()
            .map(|c| match c.expect {
                // A missing key compares as create revision 0.
                Expect::Absent => Compare::create_revision(c.key.as_str(), CompareOp::Equal, 0),
                Expect::ModRevision(rev) => {
                    Compare::mod_revision(c.key.as_str(), CompareOp::Equal, rev)
                }
            })
            .collect();
        // On failure, read back every compared key so the caller sees why.
        let reads: Vec<TxnOp> = txn
            .compares
            .iter()
            .map(|c| TxnOp::get(c.key.as_str(), None))
            .collect();
        let ops: Vec<TxnOp> = txn
            .ops
            .into_iter()
            .map(|op| match op {
                crate::store::TxnOp::Put { key, value, lease } => {
                    TxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l.0)))
                }
                crate::store::TxnOp::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        let request = Txn::new().when(compares).and_then(ops).or_else(reads);
        let mut kv = self.client.kv_client();
        let resp = kv.txn(request).await.map_err(|e| match lease {
            Some(l) if e.to_string().contains("lease not found") => StateError::LeaseNotFound(l),
            _ => self.error("transaction", &target, e),
        })?;
        if resp.succeeded() {
            return Ok(TxnOutcome::Committed {
                revision: header_revision(resp.header()),
            });
        }
        let mut current = Vec::with_capacity(resp.op_responses().len());
        for op in resp.op_responses() {
            if let TxnOpResponse::Get(get) = op {
                current.push(get.kvs().first().map(convert_kv).transpose()?);
            }
        }
        Ok(TxnOutcome::Failed { current })
    }

    async fn range(&self, prefix: &str) -> Result<RangeSnapshot> {
        let mut kv = self.client.kv_client();
        let resp = kv
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.error("range", prefix, e))?;
        Ok(RangeSnapshot {
            kvs: resp.kvs().iter().map(convert_kv).collect::<Result<_>>()?,
            revision: header_revision(resp.header()),
        })
    }

    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> Result<WatchStream> {
        let (tx, stream) = WatchStream::unbounded();
        let mut session = WatchSession {
            store: self.clone(),
            prefix: prefix.to_owned(),
            next_revision: start_revision,
            tx,
        };
        // The first attempt happens before returning, so a watch on an unreachable
        // cluster fails here rather than silently retrying forever.
        let first = session.open().await?;
        tokio::spawn(session.run(first));
        Ok(stream)
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let secs = lease_ttl_secs(ttl)?;
        let mut lease = self.client.lease_client();
        let resp = lease
            .grant(secs, None)
            .await
            .map_err(|e| self.error("lease grant", "the cluster", e))?;
        Ok(LeaseId(resp.id()))
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration> {
        let mut client = self.client.lease_client();
        let (mut keeper, mut responses) = client
            .keep_alive(lease.0)
            .await
            .map_err(|e| self.lease_error("lease keep-alive", lease, e))?;
        keeper
            .keep_alive()
            .await
            .map_err(|e| self.lease_error("lease keep-alive", lease, e))?;
        match responses.message().await {
            Ok(Some(resp)) if resp.ttl() > 0 => Ok(Duration::from_secs(resp.ttl().unsigned_abs())),
            Ok(_) => Err(StateError::LeaseNotFound(lease)),
            Err(e) => Err(self.lease_error("lease keep-alive", lease, e)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        let mut client = self.client.lease_client();
        match client.revoke(lease.0).await {
            Ok(_) => Ok(()),
            Err(e) => match self.lease_error("lease revoke", lease, e) {
                StateError::LeaseNotFound(_) => Ok(()),
                other => Err(other),
            },
        }
    }
}

/// The state of one logical watch across reconnections.
///
/// `next_revision` is one past the last revision delivered, so re-creating the
/// etcd watch from it after a disconnection neither skips nor repeats an event.
struct WatchSession {
    store: EtcdStore,
    prefix: String,
    next_revision: Option<Revision>,
    tx: tokio::sync::mpsc::UnboundedSender<Result<WatchEvent>>,
}

impl WatchSession {
    async fn open(&mut self) -> Result<etcd_client::WatchStream> {
        let mut options = WatchOptions::new().with_prefix();
        if let Some(rev) = self.next_revision {
            options = options.with_start_revision(rev);
        }
        let mut client = self.store.client.watch_client();
        let mut stream = client
            .watch(self.prefix.as_str(), Some(options))
            .await
            .map_err(|e| self.store.error("watch", &self.prefix, e))?;
        // The creation response carries the revision the watch starts after; without
        // a start revision that is where a later reconnection must resume.
        match stream.message().await {
            Ok(Some(resp)) => {
                if resp.canceled() {
                    return Err(self.cancelled(&resp));
                }
                if self.next_revision.is_none() {
                    self.next_revision = Some(header_revision(resp.header()) + 1);
                }
                self.deliver(&resp)?;
            }
            Ok(None) => {
                return Err(self.store.error(
                    "watch",
                    &self.prefix,
                    etcd_client::Error::WatchError("stream closed at creation".into()),
                ));
            }
            Err(e) => return Err(self.store.error("watch", &self.prefix, e)),
        }
        Ok(stream)
    }

    fn cancelled(&self, resp: &etcd_client::WatchResponse) -> StateError {
        if resp.compact_revision() > 0 {
            StateError::Compacted {
                prefix: self.prefix.clone(),
                requested: self.next_revision.unwrap_or(0),
                oldest: resp.compact_revision(),
            }
        } else {
            StateError::Backend {
                op: "watch",
                target: self.prefix.clone(),
                reason: format!("cancelled by the server: {}", resp.cancel_reason()),
            }
        }
    }

    /// Sends the events of `resp`; an error means the reader is gone.
    ///
    /// The floor is taken once per response: a transaction's events share one
    /// revision and etcd sends them in one response, so all of them must pass
    /// (a floor raised after the first would drop its siblings).
    fn deliver(&mut self, resp: &etcd_client::WatchResponse) -> Result<()> {
        let floor = self.next_revision;
        for event in resp.events() {
            let Some(event) = convert_event(event)? else {
                continue;
            };
            let revision = event.revision();
            if floor.is_some_and(|next| revision < next) {
                continue; // already delivered before a reconnection
            }
            self.next_revision = Some(revision + 1);
            self.tx.send(Ok(event)).map_err(|_| StateError::Backend {
                op: "watch",
                target: self.prefix.clone(),
                reason: "reader dropped".into(),
            })?;
        }
        Ok(())
    }

    async fn run(mut self, mut stream: etcd_client::WatchStream) {
        let mut backoff = WATCH_RETRY_MIN;
        loop {
            let broken = loop {
                let message = tokio::select! {
                    _ = self.tx.closed() => return,
                    message = stream.message() => message,
                };
                match message {
                    Ok(Some(resp)) if resp.canceled() => {
                        let err = self.cancelled(&resp);
                        if matches!(err, StateError::Compacted { .. }) {
                            let _ = self.tx.send(Err(err));
                            return;
                        }
                        break err.to_string();
                    }
                    Ok(Some(resp)) => {
                        if self.deliver(&resp).is_err() {
                            return;
                        }
                        backoff = WATCH_RETRY_MIN;
                    }
                    Ok(None) => break "stream ended".to_owned(),
                    Err(e) => break e.to_string(),
                }
            };
            tracing::warn!(prefix = %self.prefix, next_revision = ?self.next_revision,
                reason = %broken, "etcd watch interrupted; re-establishing");
            loop {
                tokio::select! {
                    _ = self.tx.closed() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(WATCH_RETRY_MAX);
                match self.open().await {
                    Ok(reopened) => {
                        tracing::info!(prefix = %self.prefix, next_revision = ?self.next_revision,
                            "etcd watch re-established");
                        stream = reopened;
                        break;
                    }
                    Err(err @ StateError::Compacted { .. }) => {
                        let _ = self.tx.send(Err(err));
                        return;
                    }
                    Err(err) => {
                        if self.tx.is_closed() {
                            return;
                        }
                        tracing::debug!(prefix = %self.prefix, %err, "etcd watch retry failed");
                    }
                }
            }
        }
    }
}
