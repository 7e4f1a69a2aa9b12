//! The members of an etcd cluster as one client sees them, and moving between them
//! when one is lost.
//!
//! Why not etcd-client's own multi-endpoint client: it puts every endpoint behind
//! one tonic balance channel, which keeps routing requests to a member that is gone
//! (they fail with "tcp connect error") and never re-sends them; it also shares one
//! authentication token between members, while etcd's simple tokens are valid only
//! on the member that issued them. Here each member has its own lazily connected
//! channel and its own client, and every request goes through [`Members::call`] (lease
//! keep-alives through its hedged form, below):
//!
//! - it is sent to the *preferred* member: the first endpoint listed at start,
//!   afterwards the last member that answered (so an operator can spread clients
//!   over the cluster by listing the endpoints in different orders);
//! - when that member cannot be reached (connection refused or reset, no answer
//!   within the attempt timeout, or "no leader" / "leader changed" while the
//!   cluster elects one), the same request is sent at once to the next member, and
//!   the one that answers becomes the preferred member for every later request;
//! - when no member answers, the members are tried again with a short backoff until
//!   [`FAILOVER_BUDGET`] has passed since the request started; only then does the
//!   caller see [`StateError::Unavailable`].
//!
//! Lease keep-alives are hedged ([`Members::call_hedged`]): once the member asked has
//! been silent for a tenth of the lease's TTL, the next one is asked too, and the first
//! answer wins, so a hung member costs a short lease a fraction of its TTL rather than an
//! attempt timeout. An answer that overtook the preferred member's makes the answering
//! member preferred only the second time in a row (see [`OVERTAKES_BEFORE_MOVE`]).
//!
//! So a killed member costs a request one refused connection (milliseconds), the
//! loss of the leader costs it the election (about one etcd election timeout) or,
//! for a write caught in flight, one write attempt timeout, and a hung member one
//! attempt timeout; every request succeeds or fails within [`FAILOVER_BOUND`].
//! Watches follow: a watch stream open on the member the requests moved away from
//! is reopened on the new one ([`Members::moves`]), from the revision after the last
//! one it delivered. A hung member keeps its streams open and silent, and its
//! connection's pings would find it only after [`PING_INTERVAL`] + [`PING_TIMEOUT`].
//!
//! Re-sending is safe for every request the store makes: reads, lease keep-alives
//! and revokes are idempotent; a put or a delete re-applied has the same effect;
//! a transaction is always guarded by comparisons, so if the lost attempt did
//! commit, the re-sent one fails its comparisons and answers what is there now
//! (see [`crate::EtcdStore`]'s notes on transactions). A lease grant re-sent after
//! a lost answer may leave an unused lease behind, which expires after its TTL.
//!
//! Every request carries etcd's "require leader" flag, so a member cut off from
//! the others answers "no leader" at once instead of serving stale reads or
//! holding writes until its own timeout, and closes watch streams it can no longer
//! feed, which makes [`crate::EtcdStore`]'s watches move too.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};
use tokio::sync::OnceCell;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::error::{Result, StateError};
use crate::etcd_config::EtcdConfig;

/// How long one request keeps trying the members before it fails with
/// [`StateError::Unavailable`]: long enough for etcd to elect a new leader after
/// the old one is lost (one to two election timeouts, 1 s each by default),
/// short enough that a cluster that is really down is reported while the operator
/// still watches.
pub const FAILOVER_BUDGET: Duration = Duration::from_secs(5);
/// How long one attempt of a read (get, range, watch creation) on one member may
/// take before the member counts as lost for that request. etcd itself gives up
/// after 5 s plus two election timeouts; etcdctl's default command timeout is 5 s.
/// Reads are where large answers are, hence the longer of the two.
pub const READ_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// The same for writes (put, delete, transaction). A write sent to a follower just
/// as the leader dies is forwarded to the dead leader and never answered until a
/// timeout (etcd does not fail it on a leader change, as it does reads): this is
/// what bounds the cost of losing the leader for a write, so it is short. Writes
/// are small; one that takes longer is re-sent, which is safe (module docs).
pub const WRITE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// The same for lease and status requests, which are tiny: a lease keep-alive
/// stuck on a hung member must move long before the lease's TTL runs out (a
/// keep-alive of a short lease waits less, see `EtcdStore::keep_alive`).
pub const LEASE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest any request can take before it succeeds or fails with
/// [`StateError::Unavailable`]: the budget, plus the last attempt started within it.
pub const FAILOVER_BOUND: Duration =
    Duration::from_secs(FAILOVER_BUDGET.as_secs() + READ_ATTEMPT_TIMEOUT.as_secs());
/// How long establishing a TCP (and TLS) connection to a member may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 pings on idle connections find a member that vanished without closing
/// them (a host that lost power). etcd refuses pings more often than every 5 s.
const PING_INTERVAL: Duration = Duration::from_secs(10);
const PING_TIMEOUT: Duration = Duration::from_secs(5);
/// How many hedged answers in a row must overtake the preferred member's silent attempt
/// before the answering member becomes preferred. One is not enough: a member that is
/// slow but serving (a loaded machine) would move every request and reopen every watch.
/// Two are needed, not a failure: the overtaken attempt is cancelled, so it never fails,
/// and a process whose only requests are keep-alives (a tuner holding its device) would
/// otherwise keep its watches on a hung member until the connection's pings find it.
const OVERTAKES_BEFORE_MOVE: usize = 2;
/// First and largest pause between two rounds over every member.
const ROUND_PAUSE_MIN: Duration = Duration::from_millis(50);
const ROUND_PAUSE_MAX: Duration = Duration::from_millis(800);

/// One member: its endpoint, a channel connected on first use (and reconnected
/// after a loss), and the etcd client over it (authenticated when credentials are
/// configured, which needs the member to answer, hence created on first use too).
struct Member {
    endpoint: String,
    channel: Channel,
    client: OnceCell<Client>,
}

/// How one attempt on one member ended, when it did not succeed.
pub(crate) enum AttemptError {
    /// The member could not serve it (unreachable, too slow, no leader): try another.
    Member(String),
    /// The member answered with an error that another member would repeat.
    Rejected(etcd_client::Error),
}

impl From<etcd_client::Error> for AttemptError {
    fn from(err: etcd_client::Error) -> AttemptError {
        if member_failed(&err) {
            AttemptError::Member(err.to_string())
        } else {
            AttemptError::Rejected(err)
        }
    }
}

/// What a request that did not succeed ran into.
pub(crate) enum Failure {
    /// No member could serve it within the budget.
    Unreachable(StateError),
    /// A member refused it.
    Rejected(etcd_client::Error),
}

/// The members of one cluster, with the one requests go to first.
pub(crate) struct Members {
    members: Vec<Member>,
    preferred: AtomicUsize,
    /// Hedged answers in a row that overtook the preferred member's attempt.
    overtaken: AtomicUsize,
    /// The preferred member's index after each move, for watches: a watch stream
    /// stays on the member it was opened on, and one that hangs (rather than closing
    /// its connections) would hold it until the connection's pings time out.
    moves: tokio::sync::watch::Sender<usize>,
    options: ConnectOptions,
    joined: String,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Members")
            .field("endpoints", &self.joined)
            .field("preferred", &self.preferred.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Members {
    /// Channels to every member of `config`; nothing is connected yet.
    pub(crate) fn new(config: &EtcdConfig) -> Result<Members> {
        let joined = config.joined();
        let invalid = |reason: String| StateError::InvalidUrl {
            url: joined.clone(),
            reason,
        };
        if config.endpoints.is_empty() {
            return Err(invalid("no etcd endpoints given".into()));
        }
        let tls = config.tls.as_ref().map(tls_config).transpose()?;
        let mut members = Vec::with_capacity(config.endpoints.len());
        for endpoint in &config.endpoints {
            let scheme = if tls.is_some() { "https" } else { "http" };
            let mut builder = Endpoint::from_shared(format!("{scheme}://{endpoint}"))
                .map_err(|e| invalid(format!("endpoint {endpoint}: {e}")))?
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(PING_INTERVAL)
                .keep_alive_timeout(PING_TIMEOUT)
                .keep_alive_while_idle(true);
            if let Some(tls) = &tls {
                builder = builder
                    .tls_config(tls.clone())
                    .map_err(|e| invalid(format!("TLS for {endpoint}: {e}")))?;
            }
            members.push(Member {
                endpoint: endpoint.clone(),
                channel: builder.connect_lazy(),
                client: OnceCell::new(),
            });
        }
        let mut options = ConnectOptions::new().with_require_leader(true);
        if let Some(credentials) = &config.credentials {
            options = options
                .with_user(credentials.user.clone(), credentials.password.clone())
                // Simple tokens die with a member restart and expire when idle.
                .with_auto_token_refresh(true);
        }
        Ok(Members {
            members,
            preferred: AtomicUsize::new(0),
            overtaken: AtomicUsize::new(0),
            moves: tokio::sync::watch::Sender::new(0),
            options,
            joined,
        })
    }

    /// The endpoints joined by commas, for messages.
    pub(crate) fn joined(&self) -> &str {
        &self.joined
    }

    /// The endpoint requests go to first.
    pub(crate) fn preferred_endpoint(&self) -> &str {
        &self.members[self.preferred_index()].endpoint
    }

    /// The index of the member requests go to first.
    pub(crate) fn preferred_index(&self) -> usize {
        self.preferred.load(Ordering::Relaxed) % self.members.len()
    }

    /// Tells of every move of the requests to another member (the new preferred
    /// member's index): a watch open on the member left behind reopens on the new one
    /// rather than wait for its connection's pings to find the member gone.
    pub(crate) fn moves(&self) -> tokio::sync::watch::Receiver<usize> {
        self.moves.subscribe()
    }

    async fn client(&self, member: &Member) -> Result<Client, etcd_client::Error> {
        member
            .client
            .get_or_try_init(|| {
                Client::from_channel(
                    etcd_client::Channel::Tonic(member.channel.clone()),
                    Some(self.options.clone()),
                )
            })
            .await
            .cloned()
    }

    /// Runs `attempt` on the preferred member and, while members cannot serve it,
    /// on the others, as the module documentation describes. `what` names the
    /// request in messages; `attempt_timeout` bounds each attempt. Returns the answer
    /// and the index of the member that gave it.
    pub(crate) async fn call<T, F, Fut>(
        &self,
        what: &str,
        attempt_timeout: Duration,
        budget: Duration,
        attempt: F,
    ) -> Result<(T, usize), Failure>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, AttemptError>>,
    {
        self.call_hedged(what, attempt_timeout, None, budget, attempt)
            .await
    }

    /// [`Members::call`], except that with `hedge_after` an attempt that has not answered
    /// within it no longer holds the next member back: that one is asked too, while the
    /// first may still answer, and the first answer wins. For requests whose deadline is
    /// shorter than an attempt timeout on a hung member (a short lease's keep-alive).
    /// An answer that overtook a silent attempt of the preferred member moves the
    /// requests to its member only if an attempt failed or the previous hedged answer
    /// overtook it too ([`OVERTAKES_BEFORE_MOVE`]): a member that is slow but serving
    /// keeps the requests and watches (a move reopens every watch). A member that fails
    /// while another is still silent is followed by the next one at once.
    pub(crate) async fn call_hedged<T, F, Fut>(
        &self,
        what: &str,
        attempt_timeout: Duration,
        hedge_after: Option<Duration>,
        budget: Duration,
        attempt: F,
    ) -> Result<(T, usize), Failure>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, AttemptError>>,
    {
        use futures::stream::{FuturesUnordered, StreamExt};
        let started = Instant::now();
        let count = self.members.len();
        let mut pause = ROUND_PAUSE_MIN;
        let mut failures: Vec<String> = Vec::new();
        let attempt = &attempt;
        loop {
            let first = self.preferred.load(Ordering::Relaxed) % count;
            // The round's attempts, by step (0: the preferred member), as they end.
            let mut in_flight = FuturesUnordered::new();
            let mut pending: Vec<usize> = Vec::new();
            let mut next_step = 0;
            let mut hedge_at = None;
            loop {
                let hedge_due = hedge_at.is_some_and(|at| tokio::time::Instant::now() >= at);
                if next_step < count && (in_flight.is_empty() || hedge_due) {
                    let step = next_step;
                    next_step += 1;
                    let member = &self.members[(first + step) % count];
                    in_flight.push(async move {
                        (
                            step,
                            self.attempt_on(member, attempt_timeout, attempt).await,
                        )
                    });
                    pending.push(step);
                    hedge_at = hedge_after.map(|after| tokio::time::Instant::now() + after);
                    continue;
                }
                let ended = match hedge_at.filter(|_| next_step < count) {
                    Some(at) => tokio::select! {
                        ended = in_flight.next() => ended,
                        () = tokio::time::sleep_until(at) => continue,
                    },
                    None => in_flight.next().await,
                };
                let Some((step, outcome)) = ended else {
                    break;
                };
                pending.retain(|s| *s != step);
                let index = (first + step) % count;
                match outcome {
                    Ok(value) => {
                        let overtook = pending.contains(&0);
                        self.answered(first, index, overtook, what, started, &failures);
                        return Ok((value, index));
                    }
                    Err(AttemptError::Rejected(err)) => return Err(Failure::Rejected(err)),
                    Err(AttemptError::Member(reason)) => {
                        let member = &self.members[index];
                        tracing::debug!(member = %member.endpoint, request = what, %reason,
                            "etcd member could not serve the request; trying the next one");
                        failures.push(format!("{}: {reason}", member.endpoint));
                        if hedge_after.is_some() {
                            // Its turn to wait is over: the next member now, not a
                            // hedge delay after the last one was asked.
                            hedge_at = Some(tokio::time::Instant::now());
                        }
                    }
                }
            }
            if started.elapsed() + pause > budget {
                return Err(self.unreachable(what, started, &failures));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(ROUND_PAUSE_MAX);
        }
    }

    /// After member `index` answered a request that started on `first`: makes it the
    /// preferred member when an attempt failed or it answered on another member, except
    /// for a first hedged answer that overtook the preferred member's silent attempt (see
    /// [`Members::call_hedged`]).
    fn answered(
        &self,
        first: usize,
        index: usize,
        overtook: bool,
        what: &str,
        started: Instant,
        failures: &[String],
    ) {
        if index == first {
            self.overtaken.store(0, Ordering::Relaxed);
        }
        // Counted only while `first` is still the preferred member: a request that
        // started before a move says nothing about the member requests go to now.
        let still_preferred = self.preferred.load(Ordering::Relaxed) % self.members.len() == first;
        let hold = overtook
            && failures.is_empty()
            && (!still_preferred
                || self.overtaken.fetch_add(1, Ordering::Relaxed) + 1 < OVERTAKES_BEFORE_MOVE);
        if hold {
            tracing::debug!(member = %self.members[index].endpoint, request = what,
                "etcd request answered by a member asked after a silent one");
        } else if index != first || !failures.is_empty() {
            self.overtaken.store(0, Ordering::Relaxed);
            self.moved(first, index, what, started, failures);
        }
    }

    /// One attempt of a request on `member`, bounded by `attempt_timeout`.
    async fn attempt_on<T, F, Fut>(
        &self,
        member: &Member,
        attempt_timeout: Duration,
        attempt: &F,
    ) -> Result<T, AttemptError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, AttemptError>>,
    {
        tokio::time::timeout(attempt_timeout, async {
            let client = self.client(member).await?;
            attempt(client).await
        })
        .await
        .unwrap_or_else(|_| {
            Err(AttemptError::Member(format!(
                "no answer within {attempt_timeout:?}"
            )))
        })
    }

    /// The failure of a request no member could serve within its budget, with the
    /// reasons of the last round.
    fn unreachable(&self, what: &str, started: Instant, failures: &[String]) -> Failure {
        let last = failures
            .iter()
            .rev()
            .take(self.members.len())
            .rev()
            .cloned();
        Failure::Unreachable(StateError::Unavailable {
            endpoints: self.joined.clone(),
            reason: format!(
                "{what}: no member could serve it within {:.1} s ({})",
                started.elapsed().as_secs_f64(),
                last.collect::<Vec<_>>().join("; ")
            ),
        })
    }

    /// Makes `to` the preferred member after a request succeeded there.
    fn moved(&self, from: usize, to: usize, what: &str, started: Instant, failures: &[String]) {
        let previous =
            self.preferred
                .compare_exchange(from, to, Ordering::Relaxed, Ordering::Relaxed);
        let elapsed_ms = started.elapsed().as_millis();
        let failed = failures.join("; ");
        if previous.is_ok() && from != to {
            self.moves.send_replace(to);
            tracing::warn!(from = %self.members[from].endpoint, to = %self.members[to].endpoint,
                request = what, elapsed_ms, %failed,
                "etcd member lost; requests now go to another member");
        } else {
            tracing::info!(member = %self.members[to].endpoint, request = what, elapsed_ms,
                %failed, "etcd request served after retrying");
        }
    }
}

/// Whether `err` says the member could not serve the request (rather than that
/// the cluster refused it), so another member, or the same one later, may.
fn member_failed(err: &etcd_client::Error) -> bool {
    use tonic::Code;
    if super::lease_not_found(err) {
        // The cluster's answer, whichever member (or stream) carried it.
        return false;
    }
    match err {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        // A stream that ended or broke before answering: the member went away.
        etcd_client::Error::WatchError(_) | etcd_client::Error::LeaseKeepAliveError(_) => true,
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            // Connection refused or lost, "no leader", "leader changed", "request
            // timed out", "server stopped": all mean "not this member, not now".
            Code::Unavailable | Code::DeadlineExceeded => true,
            // A stream reset by the member's death, or a connection error that
            // tonic could not classify; the cluster itself never answers these.
            Code::Cancelled | Code::Unknown => true,
            Code::Internal => status.message().contains("h2 protocol error"),
            _ => false,
        },
        _ => false,
    }
}

fn tls_config(tls: &crate::etcd_config::EtcdTls) -> Result<ClientTlsConfig> {
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| StateError::InvalidUrl {
            url: format!("etcds://… {what}={}", path.display()),
            reason: format!("cannot read the {what} file: {e}"),
        })
    };
    let mut config = ClientTlsConfig::new();
    config = match &tls.ca {
        Some(ca) => config.ca_certificate(Certificate::from_pem(read("ca", ca)?)),
        None => config.with_native_roots(),
    };
    match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => {
            config = config.identity(Identity::from_pem(read("cert", cert)?, read("key", key)?));
        }
        (None, None) => {}
        _ => {
            return Err(StateError::InvalidUrl {
                url: "etcds://…".into(),
                reason: "a client certificate needs its key and a key its certificate \
                         (give both cert= and key=)"
                    .into(),
            });
        }
    }
    Ok(config)
}
