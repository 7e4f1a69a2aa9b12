//! The etcd backend, for clusters of many machines.
//!
//! Requests move between the cluster's members on their own when one is lost
//! (see [`members`] for how and within what bound); [`crate::etcd_config`] says how
//! the cluster is reached (endpoints, TLS, credentials).
//!
//! Transactions after a member loss: a transaction whose member was lost while it
//! was in flight is re-sent to another member. If the lost attempt had in fact
//! committed, the re-sent one fails its comparisons and the outcome is
//! [`TxnOutcome::Failed`] whose `current` values show the transaction's own writes.
//! Callers therefore decide from `current` (as the placer does: a placement that
//! exists is answered as the placement), never from "failed" alone; etcd's own
//! clients leave the same ambiguity to their callers, as an error.

mod members;

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};

use crate::etcd_config::EtcdConfig;
pub use members::{
    FAILOVER_BOUND, FAILOVER_BUDGET, LEASE_ATTEMPT_TIMEOUT, READ_ATTEMPT_TIMEOUT,
    WRITE_ATTEMPT_TIMEOUT,
};

use crate::error::{Result, StateError};
use crate::store::{
    Expect, KeyValue, LeaseId, RangePage, RangeSnapshot, Revision, StateStore, TxnOutcome,
    WatchEvent, WatchStream, lease_ttl_secs,
};
use members::{AttemptError, Failure, Members};

/// How long connecting may take: every member is tried, through one election.
const CONNECT_BUDGET: Duration = Duration::from_secs(3);
/// First and largest pause between attempts to re-establish a broken watch.
const WATCH_RETRY_MIN: Duration = Duration::from_millis(100);
const WATCH_RETRY_MAX: Duration = Duration::from_secs(2);

/// A [`StateStore`] on an etcd cluster (API v3).
#[derive(Clone)]
pub struct EtcdStore {
    members: std::sync::Arc<Members>,
    config: std::sync::Arc<EtcdConfig>,
    /// Most keys one range request asks for (see [`crate::DEFAULT_PAGE_SIZE`]).
    page_size: usize,
    /// Per prefix, the page size [`StateStore::range_page`] learned by halving a page
    /// too large for one answer: later pages of that prefix (a paged reader's next
    /// call) ask for at most that many keys instead of learning it again.
    page_limits: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    /// Each lease's TTL as granted or last refreshed through this store, and when,
    /// which bounds its keep-alive attempts (see
    /// [`EtcdStore::keep_alive_attempt_timeout`]).
    lease_ttls: std::sync::Arc<std::sync::Mutex<LeaseTtls>>,
}

/// Lease id → (TTL, when it was granted or last refreshed).
type LeaseTtls = std::collections::HashMap<i64, (Duration, std::time::Instant)>;

/// The shortest attempt a keep-alive gets on one member, however short its lease: it
/// also covers connecting to the member (TCP, TLS, authentication) when its channel
/// has not been used yet.
const KEEP_ALIVE_ATTEMPT_MIN: Duration = Duration::from_secs(1);
/// How long a keep-alive waits for one member before it asks the next one as well
/// (see [`members::Members::call_hedged`]), within these bounds: a tenth of the lease's
/// TTL, so that a hung member costs a short lease a fraction of its TTL rather than an
/// attempt timeout, but at least 200 ms, so that only a keep-alive slower than that
/// (not the milliseconds a healthy member takes) is sent twice.
const KEEP_ALIVE_HEDGE_MIN: Duration = Duration::from_millis(200);
const KEEP_ALIVE_HEDGE_MAX: Duration = Duration::from_secs(1);

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("config", &self.config)
            .field("members", &self.members)
            .finish()
    }
}

/// Whether an etcd error says the lease does not exist.
fn lease_not_found(err: &etcd_client::Error) -> bool {
    err.to_string().contains("lease not found")
}

impl EtcdStore {
    /// Connects to the cluster at `endpoints` (`host:port`) in plain text without
    /// credentials; see [`EtcdStore::connect_with`].
    pub async fn connect(endpoints: &[String]) -> Result<EtcdStore> {
        Self::connect_with(&EtcdConfig::plain(endpoints.to_vec())).await
    }

    /// Connects to the cluster `config` describes and checks that a member answers
    /// (authenticating when credentials are given), so a wrong address, certificate
    /// or password fails here with a clear message rather than at first use.
    pub async fn connect_with(config: &EtcdConfig) -> Result<EtcdStore> {
        let store = Self::unchecked(config)?;
        store.status(CONNECT_BUDGET).await?;
        Ok(store)
    }

    /// The store for `config`, nothing asked of the cluster yet (no member connected).
    fn unchecked(config: &EtcdConfig) -> Result<EtcdStore> {
        Ok(EtcdStore {
            members: std::sync::Arc::new(Members::new(config)?),
            config: std::sync::Arc::new(config.clone()),
            page_size: crate::store::DEFAULT_PAGE_SIZE,
            page_limits: std::sync::Arc::default(),
            lease_ttls: std::sync::Arc::default(),
        })
    }

    /// The same store reading ranges in pages of at most `page_size` keys (at least 1)
    /// instead of [`crate::DEFAULT_PAGE_SIZE`]: tests page through a few hundred keys
    /// rather than writing tens of thousands.
    pub fn with_page_size(mut self, page_size: usize) -> EtcdStore {
        self.page_size = page_size.max(1);
        self
    }

    /// One range request: at most `*limit` keys under `prefix` after `after`, at
    /// `revision` (the newest with `None`). A page too large for one gRPC message
    /// (values far larger than iadeep writes) is asked for again in halves, and
    /// `*limit` keeps the halved size for the caller's next page.
    async fn read_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: &mut usize,
        revision: Option<Revision>,
    ) -> Result<RangePage> {
        let start: Vec<u8> = match after {
            Some(after) if after >= prefix => [after.as_bytes(), &[0]].concat(),
            _ => prefix.as_bytes().to_vec(),
        };
        let end = prefix_end(prefix);
        *limit = (*limit).max(1);
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(i64::try_from(*limit).unwrap_or(i64::MAX));
            if let Some(revision) = revision {
                options = options.with_revision(revision);
            }
            let result = self
                .request("range", READ_ATTEMPT_TIMEOUT, |client| {
                    let (start, options) = (start.clone(), options.clone());
                    async move { Ok(client.kv_client().get(start, Some(options)).await?) }
                })
                .await;
            let resp = match result {
                Ok(resp) => resp,
                Err(Failure::Rejected(err)) if too_large(&err) && *limit > 1 => {
                    tracing::debug!(%prefix, limit = *limit, %err, "range page too large; halving it");
                    *limit /= 2;
                    continue;
                }
                Err(Failure::Rejected(err)) if compacted(&err) => {
                    return Err(StateError::Compacted {
                        prefix: prefix.to_owned(),
                        requested: revision.unwrap_or(0),
                        oldest: 0,
                    });
                }
                Err(f) => return Err(self.failed("range", prefix, f)),
            };
            return Ok(RangePage {
                kvs: resp.kvs().iter().map(convert_kv).collect::<Result<_>>()?,
                revision: header_revision(resp.header()),
                more: resp.more(),
            });
        }
    }

    /// Every key under `prefix` at one revision, page by page: the first page's
    /// revision pins the later ones.
    async fn read_all(&self, prefix: &str) -> Result<RangeSnapshot> {
        let mut limit = self.page_size;
        let first = self.read_page(prefix, None, &mut limit, None).await?;
        let revision = first.revision;
        let mut more = first.more;
        let mut kvs = first.kvs;
        while more {
            let after = kvs.last().map(|kv| kv.key.clone());
            let page = self
                .read_page(prefix, after.as_deref(), &mut limit, Some(revision))
                .await?;
            more = page.more && !page.kvs.is_empty();
            kvs.extend(page.kvs);
        }
        Ok(RangeSnapshot { kvs, revision })
    }

    /// The page sizes [`StateStore::range_page`] learned, per prefix.
    fn page_limits(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, usize>> {
        self.page_limits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The version of the etcd server answering (e.g. `3.4.23`).
    pub async fn server_version(&self) -> Result<String> {
        self.status(FAILOVER_BUDGET).await
    }

    /// A warning for an operator when the etcd answering has etcd-io/etcd#15247 and the
    /// cluster has several members: a leader that hung and resumes revokes the leases it
    /// saw expire meanwhile, though the new leader kept them alive. `None` for a fixed
    /// etcd (3.4.31, 3.5.13 and later), a one-member cluster, or an etcd that does not say
    /// its version or members.
    pub async fn lease_bug_warning(&self) -> Option<String> {
        let version = self.server_version().await.ok()?;
        // One member has no other leader to keep leases alive while it hangs.
        (revokes_live_leases(&version) && self.member_count().await.ok()? > 1).then(|| {
            format!(
                "etcd {version} answers at {}: in a cluster of several members, a leader \
                 that hangs and resumes may revoke leases the new leader kept alive \
                 (etcd-io/etcd#15247, fixed in 3.4.31 and 3.5.13). Agents and tuners then \
                 register again, and nothing is released before the placer's dead-task \
                 grace; upgrade etcd to avoid it",
                self.current_endpoint()
            )
        })
    }

    /// The member requests go to first now (`host:port`): the last one that answered.
    pub fn current_endpoint(&self) -> String {
        self.members.preferred_endpoint().to_owned()
    }

    /// How many members the cluster lists.
    async fn member_count(&self) -> Result<usize> {
        self.members
            .call(
                "member list",
                LEASE_ATTEMPT_TIMEOUT,
                FAILOVER_BUDGET,
                |client| async move {
                    let listed = client.cluster_client().member_list().await?;
                    Ok(listed.members().len())
                },
            )
            .await
            .map(|(count, _)| count)
            .map_err(|f| self.failed("member list", "the cluster", f))
    }

    async fn status(&self, budget: Duration) -> Result<String> {
        self.members
            .call(
                "status",
                LEASE_ATTEMPT_TIMEOUT,
                budget,
                |client| async move {
                    let status = client.maintenance_client().status().await?;
                    Ok(status.version().to_owned())
                },
            )
            .await
            .map(|(version, _)| version)
            .map_err(|f| match f {
                Failure::Rejected(err) if is_auth_error(&err) => StateError::Backend {
                    op: "authenticate",
                    target: self.members.joined().to_owned(),
                    reason: format!(
                        "{err} (check the user and password of the store URL{})",
                        self.config
                            .credentials
                            .as_ref()
                            .map(|c| format!(", user {:?}", c.user))
                            .unwrap_or_default()
                    ),
                },
                other => self.failed("status", "the cluster", other),
            })
    }

    /// How long one keep-alive of `lease` may wait for one member: a quarter of the
    /// lease's TTL, within [`KEEP_ALIVE_ATTEMPT_MIN`] and [`LEASE_ATTEMPT_TIMEOUT`]. The
    /// next member is asked long before (see [`EtcdStore::keep_alive_hedge`]); this
    /// bounds the attempts that keep running beside it, and, with [`crate::LeaseKeeper`]
    /// refreshing every third of the TTL, a fixed 2 s let a 3 s lease expire behind a
    /// hung member before keep-alives were hedged.
    fn keep_alive_attempt_timeout(&self, lease: LeaseId) -> Duration {
        self.lease_ttl(lease).map_or(LEASE_ATTEMPT_TIMEOUT, |ttl| {
            (ttl / 4).clamp(KEEP_ALIVE_ATTEMPT_MIN, LEASE_ATTEMPT_TIMEOUT)
        })
    }

    /// How long one keep-alive of `lease` waits for a member before asking the next one
    /// too: a tenth of its TTL, within [`KEEP_ALIVE_HEDGE_MIN`] and
    /// [`KEEP_ALIVE_HEDGE_MAX`]. Even a quarter of the TTL left a 2 s lease a third of a
    /// second of margin behind a hung member (a third of the TTL between refreshes, then
    /// at least the 1 s attempt).
    fn keep_alive_hedge(&self, lease: LeaseId) -> Duration {
        self.lease_ttl(lease).map_or(KEEP_ALIVE_HEDGE_MAX, |ttl| {
            (ttl / 10).clamp(KEEP_ALIVE_HEDGE_MIN, KEEP_ALIVE_HEDGE_MAX)
        })
    }

    /// The TTL `lease` was granted or last refreshed with, if this store knows it.
    fn lease_ttl(&self, lease: LeaseId) -> Option<Duration> {
        let ttls = self.lease_ttls.lock().unwrap_or_else(|e| e.into_inner());
        ttls.get(&lease.0).map(|(ttl, _)| *ttl)
    }

    /// Notes `lease`'s TTL (`None`: the lease is gone). Leases not refreshed for twice
    /// their TTL have expired (or were revoked out of sight) and are forgotten.
    fn note_lease_ttl(&self, lease: LeaseId, ttl: Option<Duration>) {
        let mut ttls = self.lease_ttls.lock().unwrap_or_else(|e| e.into_inner());
        match ttl {
            Some(ttl) => {
                ttls.retain(|_, (ttl, at)| at.elapsed() <= *ttl * 2);
                ttls.insert(lease.0, (ttl, std::time::Instant::now()));
            }
            None => {
                ttls.remove(&lease.0);
            }
        }
    }

    /// One request through the members' failover (see [`members`]), each attempt
    /// bounded by `attempt_timeout`.
    async fn request<T, F, Fut>(
        &self,
        what: &str,
        attempt_timeout: Duration,
        attempt: F,
    ) -> Result<T, Failure>
    where
        F: Fn(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, AttemptError>>,
    {
        let (answer, _) = self.request_on(what, attempt_timeout, attempt).await?;
        Ok(answer)
    }

    /// [`EtcdStore::request`], also saying which member answered (its index).
    async fn request_on<T, F, Fut>(
        &self,
        what: &str,
        attempt_timeout: Duration,
        attempt: F,
    ) -> Result<(T, usize), Failure>
    where
        F: Fn(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, AttemptError>>,
    {
        self.members
            .call(what, attempt_timeout, FAILOVER_BUDGET, attempt)
            .await
    }

    fn failed(&self, op: &'static str, target: &str, failure: Failure) -> StateError {
        match failure {
            Failure::Unreachable(err) => err,
            Failure::Rejected(err) => StateError::Backend {
                op,
                target: target.to_owned(),
                reason: err.to_string(),
            },
        }
    }

    fn lease_failed(&self, op: &'static str, lease: LeaseId, failure: Failure) -> StateError {
        match failure {
            Failure::Rejected(err) if lease_not_found(&err) => StateError::LeaseNotFound(lease),
            other => self.failed(op, &format!("lease {lease}"), other),
        }
    }
}

/// Whether etcd refused the credentials (or demands some).
fn is_auth_error(err: &etcd_client::Error) -> bool {
    let text = err.to_string();
    text.contains("authentication failed")
        || text.contains("user name is empty")
        || text.contains("invalid auth token")
        || text.contains("permission denied")
}

/// Whether a range failed because its answer exceeds the client's message limit.
fn too_large(err: &etcd_client::Error) -> bool {
    err.to_string().contains("message length too large")
}

/// Whether etcd refused a revision older than its compacted history.
fn compacted(err: &etcd_client::Error) -> bool {
    err.to_string()
        .contains("required revision has been compacted")
}

/// The end of etcd's range of keys starting with `prefix`: the prefix with its last
/// byte below 0xff incremented (`\0`, every key, when there is none).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
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
        let scheme = if self.config.tls.is_some() {
            "etcds"
        } else {
            "etcd"
        };
        format!("{scheme}://{}", self.members.joined())
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let resp = self
            .request("get", READ_ATTEMPT_TIMEOUT, |client| async move {
                Ok(client.kv_client().get(key, None).await?)
            })
            .await
            .map_err(|f| self.failed("get", key, f))?;
        resp.kvs().first().map(convert_kv).transpose()
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        let options = lease.map(|l| PutOptions::new().with_lease(l.0));
        let resp = self
            .request("put", WRITE_ATTEMPT_TIMEOUT, |client| {
                let (value, options) = (value.clone(), options.clone());
                async move { Ok(client.kv_client().put(key, value, options).await?) }
            })
            .await
            .map_err(|f| match (f, lease) {
                (Failure::Rejected(e), Some(l)) if lease_not_found(&e) => {
                    StateError::LeaseNotFound(l)
                }
                (f, _) => self.failed("put", key, f),
            })?;
        Ok(header_revision(resp.header()))
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        let resp = self
            .request("delete", WRITE_ATTEMPT_TIMEOUT, |client| async move {
                Ok(client.kv_client().delete(key, None).await?)
            })
            .await
            .map_err(|f| self.failed("delete", key, f))?;
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
        let resp = self
            .request("transaction", WRITE_ATTEMPT_TIMEOUT, |client| {
                let request = request.clone();
                async move { Ok(client.kv_client().txn(request).await?) }
            })
            .await
            .map_err(|f| match (f, lease) {
                (Failure::Rejected(e), Some(l)) if lease_not_found(&e) => {
                    StateError::LeaseNotFound(l)
                }
                (f, _) => self.failed("transaction", &target, f),
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
        // A compaction past the first page's revision while the later ones are read
        // makes that snapshot unreadable: start again at the newest revision (a few
        // times; compactions are minutes apart).
        let mut attempts = 0;
        loop {
            match self.read_all(prefix).await {
                Err(StateError::Compacted { .. }) if attempts < 3 => {
                    attempts += 1;
                    tracing::debug!(%prefix, "history compacted while paging a range; reading again");
                }
                other => return other,
            }
        }
    }

    async fn range_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<RangePage> {
        let learned = self.page_limits().get(prefix).copied();
        let asked = learned.map_or(limit, |learned| limit.min(learned));
        let mut limit = asked;
        let page = self.read_page(prefix, after, &mut limit, None).await?;
        if limit < asked {
            self.page_limits().insert(prefix.to_owned(), limit);
        }
        Ok(page)
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        let result = self
            .request("compact", WRITE_ATTEMPT_TIMEOUT, |client| async move {
                Ok(client.kv_client().compact(revision, None).await?)
            })
            .await;
        match result {
            Ok(_) => Ok(()),
            // Another placer (or etcd's own auto-compaction) got there first.
            Err(Failure::Rejected(err)) if compacted(&err) => Ok(()),
            Err(f) => Err(self.failed("compact", &format!("revision {revision}"), f)),
        }
    }

    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> Result<WatchStream> {
        let (tx, stream) = WatchStream::unbounded();
        let mut session = WatchSession {
            store: self.clone(),
            prefix: prefix.to_owned(),
            next_revision: start_revision,
            tx,
            on_member: self.members.preferred_index(),
        };
        // Subscribed before the first open, so a move while it opens is seen.
        let moves = self.members.moves();
        // The first attempt happens before returning, so a watch on an unreachable
        // cluster fails here rather than silently retrying forever.
        let first = session.open().await?;
        tokio::spawn(session.run(first, moves));
        Ok(stream)
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let secs = lease_ttl_secs(ttl)?;
        let resp = self
            .request("lease grant", LEASE_ATTEMPT_TIMEOUT, |client| async move {
                Ok(client.lease_client().grant(secs, None).await?)
            })
            .await
            .map_err(|f| self.failed("lease grant", "the cluster", f))?;
        let lease = LeaseId(resp.id());
        let granted = Duration::from_secs(resp.ttl().try_into().unwrap_or(secs.unsigned_abs()));
        self.note_lease_ttl(lease, Some(granted));
        Ok(lease)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration> {
        // One short keep-alive stream per refresh, opened on whichever member can
        // serve it: a stream kept open would die with its member. Hedged: a member that
        // hangs would otherwise hold it for a whole attempt.
        let ttl = self
            .members
            .call_hedged(
                "lease keep-alive",
                self.keep_alive_attempt_timeout(lease),
                Some(self.keep_alive_hedge(lease)),
                FAILOVER_BUDGET,
                |client| async move {
                    let (mut keeper, mut responses) =
                        client.lease_client().keep_alive(lease.0).await?;
                    keeper.keep_alive().await?;
                    match responses.message().await? {
                        Some(resp) => Ok(resp.ttl()),
                        None => Err(AttemptError::Member(
                            "keep-alive stream closed before answering".into(),
                        )),
                    }
                },
            )
            .await
            .map(|(ttl, _)| ttl)
            .map_err(|f| {
                let err = self.lease_failed("lease keep-alive", lease, f);
                if matches!(err, StateError::LeaseNotFound(_)) {
                    self.note_lease_ttl(lease, None);
                }
                err
            })?;
        if ttl > 0 {
            let ttl = Duration::from_secs(ttl.unsigned_abs());
            self.note_lease_ttl(lease, Some(ttl));
            Ok(ttl)
        } else {
            self.note_lease_ttl(lease, None);
            Err(StateError::LeaseNotFound(lease))
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        let revoked = self
            .request("lease revoke", LEASE_ATTEMPT_TIMEOUT, |client| async move {
                Ok(client.lease_client().revoke(lease.0).await?)
            })
            .await;
        self.note_lease_ttl(lease, None);
        match revoked {
            Ok(_) => Ok(()),
            Err(f) => match self.lease_failed("lease revoke", lease, f) {
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
    /// The index of the member the stream was opened on.
    on_member: usize,
}

impl WatchSession {
    /// Creates the etcd watch on a member that can serve it (see [`members`]) and
    /// delivers what its creation response carries.
    async fn open(&mut self) -> Result<etcd_client::WatchStream> {
        let mut options = WatchOptions::new().with_prefix();
        if let Some(rev) = self.next_revision {
            options = options.with_start_revision(rev);
        }
        let prefix = self.prefix.as_str();
        let ((stream, created), served_by) = self
            .store
            .request_on("watch", READ_ATTEMPT_TIMEOUT, |client| {
                let options = options.clone();
                async move {
                    let mut stream = client.watch_client().watch(prefix, Some(options)).await?;
                    // The creation response carries the revision the watch starts
                    // after; without a start revision that is where a later
                    // reconnection must resume.
                    match stream.message().await? {
                        Some(created) => Ok((stream, created)),
                        None => Err(AttemptError::Member("stream closed at creation".into())),
                    }
                }
            })
            .await
            .map_err(|f| self.store.failed("watch", &self.prefix, f))?;
        if created.canceled() {
            return Err(self.cancelled(&created));
        }
        if self.next_revision.is_none() {
            self.next_revision = Some(header_revision(created.header()) + 1);
        }
        self.on_member = served_by;
        self.deliver(&created)?;
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

    /// Delivers the stream's events until the reader goes, reopening the watch from
    /// the next revision when the stream breaks, or when the store's requests moved
    /// off the member it is on (a hung member keeps the stream open but silent; its
    /// connection's pings would find it only after `PING_INTERVAL` + `PING_TIMEOUT`).
    async fn run(
        mut self,
        mut stream: etcd_client::WatchStream,
        mut moves: tokio::sync::watch::Receiver<usize>,
    ) {
        let mut backoff = WATCH_RETRY_MIN;
        loop {
            let broken = loop {
                let message = tokio::select! {
                    _ = self.tx.closed() => return,
                    message = stream.message() => message,
                    // The sender lives as long as the store this session holds.
                    Ok(()) = moves.changed() => {
                        if *moves.borrow_and_update() == self.on_member {
                            continue;
                        }
                        break "the store's requests moved off this member".to_owned();
                    }
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

/// Whether etcd `version` (`3.4.23`, `v3.5.9`) has etcd-io/etcd#15247: 3.x before
/// 3.4.31, and 3.5 before 3.5.13. An unreadable version is not flagged.
fn revokes_live_leases(version: &str) -> bool {
    let mut parts = version
        .trim()
        .trim_start_matches('v')
        .split(['.', '-', '+'])
        .map(str::parse::<u32>);
    let (Some(Ok(major)), Some(Ok(minor)), Some(Ok(patch))) =
        (parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    major == 3 && (minor < 4 || (minor == 4 && patch < 31) || (minor == 5 && patch < 13))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{runtime, start_etcd};

    /// The versions with etcd-io/etcd#15247 are flagged, the fixed ones and anything
    /// unreadable are not.
    #[test]
    fn the_etcd_versions_that_revoke_live_leases() {
        for affected in [
            "3.4.23",
            "v3.4.30",
            "3.5.0",
            "3.5.12",
            "3.3.27",
            "3.4.23-rc1",
        ] {
            assert!(revokes_live_leases(affected), "{affected}");
        }
        for fixed in [
            "3.4.31", "3.5.13", "v3.5.17", "3.6.0", "4.0.0", "", "unknown", "3.4",
        ] {
            assert!(!revokes_live_leases(fixed), "{fixed}");
        }
    }

    /// A keep-alive whose first member hangs (a listener that accepts connections and
    /// never answers) is answered by the next member, asked once the first has been
    /// silent for the hedge delay, while the hung attempt still runs: the requests stay
    /// on the first member (one answer that overtook a silent attempt moves nothing),
    /// where the sequential failover would have moved them after the attempt timed out;
    /// the second such answer in a row moves them.
    #[test]
    fn a_keep_alive_asks_the_next_member_while_the_first_is_silent() {
        let server = start_etcd();
        let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let hung_endpoint = format!("127.0.0.1:{}", hung.local_addr().expect("addr").port());
        runtime().block_on(async {
            let granter = EtcdStore::connect(&[server.endpoint()])
                .await
                .expect("connect to etcd");
            let lease = granter
                .grant_lease(Duration::from_secs(60))
                .await
                .expect("grant");
            // Not `connect`: its status request would move the requests off the hung
            // member before the keep-alive is sent.
            let config = EtcdConfig::plain(vec![hung_endpoint.clone(), server.endpoint()]);
            let store = EtcdStore::unchecked(&config).expect("store");
            // Not granted by this store: the full attempt (2 s), hedged after 1 s.
            assert_eq!(store.keep_alive_hedge(lease), KEEP_ALIVE_HEDGE_MAX);
            let ttl = store.keep_alive(lease).await.expect("kept alive");
            assert_eq!(ttl, Duration::from_secs(60));
            assert_eq!(
                store.current_endpoint(),
                hung_endpoint,
                "one overtake moves nothing"
            );
            store.keep_alive(lease).await.expect("kept alive again");
            assert_eq!(
                store.current_endpoint(),
                server.endpoint(),
                "the second in a row moves the requests"
            );
        });
        drop(hung);
    }

    /// A keep-alive waits a quarter of its lease's TTL for one member, within 1–2 s, and
    /// the full 2 s for a lease this store did not grant nor refresh, and asks the next
    /// member too after a tenth of the TTL, within 0.2–1 s; a revoked lease, one the
    /// cluster no longer knows, or one not refreshed for twice its TTL is forgotten.
    #[test]
    fn a_keep_alive_waits_for_one_member_a_quarter_of_its_leases_ttl() {
        let server = start_etcd();
        runtime().block_on(async {
            let store = EtcdStore::connect(&[server.endpoint()])
                .await
                .expect("connect to etcd");
            let mut leases = Vec::new();
            for (ttl_s, attempt_ms, hedge_ms) in
                [(3, 1_000, 300), (6, 1_500, 600), (60, 2_000, 1_000)]
            {
                let lease = store
                    .grant_lease(Duration::from_secs(ttl_s))
                    .await
                    .expect("grant");
                assert_eq!(
                    store.keep_alive_attempt_timeout(lease),
                    Duration::from_millis(attempt_ms),
                    "TTL {ttl_s} s"
                );
                assert_eq!(
                    store.keep_alive_hedge(lease),
                    Duration::from_millis(hedge_ms),
                    "TTL {ttl_s} s"
                );
                leases.push(lease);
            }
            let unknown = LeaseId(leases[0].0 + 1_000_000);
            assert_eq!(
                store.keep_alive_attempt_timeout(unknown),
                LEASE_ATTEMPT_TIMEOUT
            );
            assert_eq!(store.keep_alive_hedge(unknown), KEEP_ALIVE_HEDGE_MAX);
            store.revoke_lease(leases[1]).await.expect("revoke");
            assert_eq!(
                store.keep_alive_attempt_timeout(leases[1]),
                LEASE_ATTEMPT_TIMEOUT
            );
            let other = EtcdStore::connect(&[server.endpoint()])
                .await
                .expect("connect to etcd");
            other
                .revoke_lease(leases[0])
                .await
                .expect("revoke elsewhere");
            let err = store.keep_alive(leases[0]).await.expect_err("gone");
            assert!(matches!(err, StateError::LeaseNotFound(_)), "{err}");
            assert_eq!(
                store.keep_alive_attempt_timeout(leases[0]),
                LEASE_ATTEMPT_TIMEOUT
            );
            assert_eq!(
                store.lease_ttls.lock().expect("lock").len(),
                1,
                "the 60 s lease"
            );
            // A lease not refreshed for twice its TTL (expired, or revoked out of sight)
            // is forgotten with the next one noted.
            let long_ago = std::time::Instant::now()
                .checked_sub(Duration::from_secs(10))
                .expect("a monotonic clock past 10 s");
            store
                .lease_ttls
                .lock()
                .expect("lock")
                .insert(42, (Duration::from_secs(3), long_ago));
            store.keep_alive(leases[2]).await.expect("refresh");
            let ttls = store.lease_ttls.lock().expect("lock");
            assert!(!ttls.contains_key(&42), "{ttls:?}");
            assert!(ttls.contains_key(&leases[2].0));
        });
    }

    /// 500 values of 10 KB, then 400 small ones: a first page of 1,200 keys (5 MB) is
    /// too large for one answer, and so is one of 600; it is halved to 300. The next
    /// page asks for those 300 too (asked afresh, 600 keys would fit in one answer), on
    /// this prefix only.
    #[test]
    fn a_page_size_halved_for_one_page_carries_over_to_the_next() {
        let server = start_etcd();
        runtime().block_on(async {
            let store = EtcdStore::connect(&[server.endpoint()])
                .await
                .expect("connect to etcd");
            for i in 0..900 {
                let value = if i < 500 {
                    vec![b'v'; 10 * 1024]
                } else {
                    vec![b's']
                };
                store
                    .put(&format!("/large/{i:04}"), value, None)
                    .await
                    .expect("put");
            }
            let first = store
                .range_page("/large/", None, 1_200)
                .await
                .expect("first");
            assert_eq!(first.kvs.len(), 300, "1,200 and 600 keys were too large");
            let second = store
                .range_page("/large/", first.next_after(), 1_200)
                .await
                .expect("second");
            assert_eq!(second.kvs.len(), 300, "the learned size carried over");
            let other = store
                .range_page("/large/0", Some("/large/0499"), 1_200)
                .await
                .expect("other");
            assert_eq!(other.kvs.len(), 400, "another prefix learns its own");
        });
    }
}
