//! The job's process tree, as `iadeep run` stops it when it enforces an eviction.
//!
//! Why the tree and not the job's process: `iadeep run -- bash train.sh` or `torchrun`
//! run the trainer as a child of the command. A signal to the command alone ends the
//! wrapper and orphans the trainer, which keeps the GPU while `iadeep run` re-queues the
//! job and starts a second copy beside it. Why not a process group: the job shares
//! `iadeep run`'s, so that a Ctrl-C at the terminal reaches it directly.
//!
//! The tree is read from /proc (each process's parent), at each signal: the job and its
//! descendants as they stand then, and the descendants of every process signalled
//! before (a process orphaned when the wrapper died has another parent since). A
//! process is known by its id and its start time, so an id reused by an unrelated
//! process later is never signalled. Linux only, as iadeep is.
//!
//! Why `iadeep run` makes itself the job's child subreaper ([`adopt_orphans`]): a
//! process whose parent exits is re-parented to its nearest subreaper ancestor, init
//! otherwise. A wrapper that starts the trainer with a double fork (`(python train.py
//! &)`, a daemonising launcher) leaves it a child of init from the start, outside any
//! walk down from the job. As a subreaper, `iadeep run` adopts every such process of
//! the job instead, so its own children are the job and what escaped it, and the
//! walk starts from there.

use std::collections::{BTreeMap, BTreeSet};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::Pid;

/// Whether `iadeep run` runs in the foreground process group of its controlling
/// terminal: then a SIGINT is a Ctrl-C there, which reached the job too (it shares
/// `iadeep run`'s process group). Otherwise it came from `kill` or a supervisor, to the
/// group or to `iadeep run` alone, which cannot be told apart.
pub(super) fn in_terminal_foreground() -> bool {
    let Ok(tty) = std::fs::File::open("/dev/tty") else {
        return false;
    };
    nix::unistd::tcgetpgrp(&tty).is_ok_and(|group| group == nix::unistd::getpgrp())
}

/// Makes `iadeep run` the subreaper of the processes it starts (see the module docs),
/// before it starts the job. False (with a warning) when the kernel refuses: a process
/// the job double-forks is not found then.
pub(super) fn adopt_orphans() -> bool {
    match nix::sys::prctl::set_child_subreaper(true) {
        Ok(()) => true,
        Err(err) => {
            tracing::warn!(%err, "cannot make iadeep run the subreaper of the job's processes: \
                one the job starts with a double fork escapes an eviction's signals");
            false
        }
    }
}

/// `iadeep run` as the subreaper of one run of the job ([`adopt_orphans`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Adopter {
    pid: i32,
    /// When the job started (clock ticks after boot). A child of `iadeep run` that
    /// started before it is not the job's: `sh -c 'monitor & exec iadeep run -- …'`
    /// leaves `monitor` a child of the process that became `iadeep run`.
    since: u64,
}

impl Adopter {
    /// `iadeep run`, adopting for the job it just started as `job` (`None` when /proc
    /// cannot say when the job started).
    pub(super) fn of_job(job: u32) -> Option<Adopter> {
        let stat = std::fs::read_to_string(format!("/proc/{job}/stat")).ok()?;
        Some(Adopter {
            pid: i32::try_from(std::process::id()).ok()?,
            since: parse_stat(&stat)?.start,
        })
    }

    /// The processes of `table` that `iadeep run` adopted from the job (the job itself
    /// among them while it runs): its children that started with the job or later.
    fn adopted(self, table: &[Proc]) -> impl Iterator<Item = &Proc> {
        table
            .iter()
            .filter(move |p| p.ppid == self.pid && p.start >= self.since)
    }
}

/// One process as /proc shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Proc {
    pub pid: i32,
    pub ppid: i32,
    /// Clock ticks after boot at which it started: with `pid`, its identity.
    pub start: u64,
    /// Exited, not yet reaped: it holds no memory any more.
    pub zombie: bool,
}

/// The processes of `table` descending from `roots` (roots excluded), parents before
/// their children. Pure: the unit of the tree walk, tested on a made-up table.
pub(super) fn descendants(table: &[Proc], roots: &[i32]) -> Vec<Proc> {
    let mut children: BTreeMap<i32, Vec<Proc>> = BTreeMap::new();
    for proc in table {
        children.entry(proc.ppid).or_default().push(*proc);
    }
    let mut seen: BTreeSet<i32> = roots.iter().copied().collect();
    let mut found = Vec::new();
    let mut next: Vec<i32> = roots.to_vec();
    while !next.is_empty() {
        let mut below = Vec::new();
        for parent in next {
            for child in children.get(&parent).into_iter().flatten() {
                // A table read while processes come and go can be inconsistent: each
                // process once, whatever its parent's entry says.
                if seen.insert(child.pid) {
                    found.push(*child);
                    below.push(child.pid);
                }
            }
        }
        next = below;
    }
    found
}

/// `/proc/PID/stat`'s fields that the walk needs. The command name (field 2) is in
/// parentheses and may itself hold spaces and parentheses: the fields are counted after
/// its last ')'.
fn parse_stat(text: &str) -> Option<Proc> {
    let (head, tail) = text.rsplit_once(')')?;
    let pid = head.split_once('(')?.0.trim().parse().ok()?;
    let fields: Vec<&str> = tail.split_whitespace().collect();
    // After the name: state (3), ppid (4), ... starttime (22).
    Some(Proc {
        pid,
        ppid: fields.get(1)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
        zombie: matches!(*fields.first()?, "Z" | "X"),
    })
}

/// Every process of this machine (of this PID namespace) that /proc lists now; one
/// that exits while it is read is left out.
fn processes() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        tracing::warn!("cannot read /proc: signalling the job's own process only");
        return Vec::new();
    };
    dir.filter_map(|entry| {
        let name = entry.ok()?.file_name();
        let pid: i32 = name.to_str()?.parse().ok()?;
        parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    })
    .collect()
}

/// The processes `iadeep run` signalled to enforce one run's eviction.
#[derive(Debug)]
pub(super) struct Signalled {
    /// Each by id, with its start time.
    known: BTreeMap<i32, u64>,
    /// `iadeep run` when it adopts the job's orphans: the processes it adopted are the
    /// job's.
    adopter: Option<Adopter>,
}

impl Signalled {
    /// For a job whose orphans `adopter` adopts, or nobody (`None`).
    pub(super) fn new(adopter: Option<Adopter>) -> Self {
        Self {
            known: BTreeMap::new(),
            adopter,
        }
    }

    /// The known processes still running in `table` (same id and start time, not a
    /// zombie).
    fn running(&self, table: &[Proc]) -> Vec<Proc> {
        table
            .iter()
            .filter(|p| !p.zombie && self.known.get(&p.pid) == Some(&p.start))
            .copied()
            .collect()
    }

    /// The running processes of `table` that `iadeep run` adopted from the job.
    fn adopted(&self, table: &[Proc]) -> Vec<Proc> {
        self.adopter
            .into_iter()
            .flat_map(|a| a.adopted(table))
            .filter(|p| !p.zombie)
            .copied()
            .collect()
    }

    /// Sends `sig` to the job (`job`, while it runs) and to every running process that
    /// was adopted from it or descends from it, from an adopted one or from a process
    /// signalled before, as /proc shows them now. Returns how many processes besides
    /// the job it signalled.
    pub(super) fn signal(&mut self, job: Option<i32>, sig: Signal) -> usize {
        let table = processes();
        let mut targets = self.running(&table);
        targets.extend(self.adopted(&table));
        let mut roots: Vec<i32> = targets.iter().map(|p| p.pid).collect();
        roots.extend(job);
        targets.extend(
            descendants(&table, &roots)
                .into_iter()
                .filter(|p| !p.zombie),
        );
        let mut others = BTreeSet::new();
        for proc in targets {
            if Some(proc.pid) == job {
                continue;
            }
            self.known.insert(proc.pid, proc.start);
            others.insert(proc.pid);
        }
        for &pid in job.iter().chain(&others) {
            if let Err(err) = kill(Pid::from_raw(pid), sig) {
                // Gone meanwhile (ESRCH) is what was wanted.
                if err != nix::errno::Errno::ESRCH {
                    tracing::warn!(%err, signal = %sig, pid, "cannot signal a process of the job");
                }
            }
        }
        others.len()
    }

    /// The ids of the processes signalled before that still run.
    pub(super) fn still_running(&self) -> Vec<i32> {
        self.running(&processes()).iter().map(|p| p.pid).collect()
    }

    /// Once the job exited: the processes adopted from it that still run, and their
    /// descendants (empty when `iadeep run` adopts nothing).
    pub(super) fn left_behind(&self) -> Vec<i32> {
        let table = processes();
        let adopted = self.adopted(&table);
        let roots: Vec<i32> = adopted.iter().map(|p| p.pid).collect();
        let below = descendants(&table, &roots)
            .into_iter()
            .filter(|p| !p.zombie);
        adopted
            .iter()
            .copied()
            .chain(below)
            .map(|p| p.pid)
            .collect()
    }

    /// Once the job exited: whether nothing it started runs any more, as far as
    /// `iadeep run` can tell, which is only when it adopts the job's orphans (else a
    /// double-forked trainer would not be seen).
    pub(super) fn all_gone(&self) -> bool {
        self.adopter.is_some() && self.left_behind().is_empty()
    }

    /// Once the job was waited for: collects the exit status of every process adopted
    /// from it that has exited, so that none stays a zombie while `iadeep run` goes on
    /// (re-queued runs). By pid, never `waitpid(-1)`: only the job's adopted processes
    /// are `iadeep run`'s to reap, and the job's own status is tokio's.
    pub(super) fn reap(&self) {
        let Some(adopter) = self.adopter else {
            return;
        };
        let table = processes();
        for zombie in adopter.adopted(&table).filter(|p| p.zombie) {
            // ECHILD (collected meanwhile) is "nothing to collect" too.
            let _ = waitpid(Pid::from_raw(zombie.pid), Some(WaitPidFlag::WNOHANG));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: i32, ppid: i32) -> Proc {
        Proc {
            pid,
            ppid,
            start: 1000 + pid as u64,
            zombie: false,
        }
    }

    fn pids(procs: &[Proc]) -> Vec<i32> {
        procs.iter().map(|p| p.pid).collect()
    }

    /// `bash train.sh` (10) runs `torchrun` (11), whose workers (12, 13) have a data
    /// loader each (14, 15); 20 is another job of the same user, 1 is init.
    #[test]
    fn the_tree_is_the_job_and_all_its_descendants_only() {
        let table = [
            proc(1, 0),
            proc(10, 1),
            proc(11, 10),
            proc(12, 11),
            proc(13, 11),
            proc(14, 12),
            proc(15, 13),
            proc(20, 1),
            proc(21, 20),
        ];
        assert_eq!(pids(&descendants(&table, &[10])), [11, 12, 13, 14, 15]);
        assert_eq!(pids(&descendants(&table, &[12])), [14]);
        assert_eq!(pids(&descendants(&table, &[15])), Vec::<i32>::new());
        assert_eq!(pids(&descendants(&table, &[99])), Vec::<i32>::new());
        // The wrapper (10) is gone: its child was re-parented to init, and is found as
        // a descendant of the process signalled before.
        let orphaned = [proc(1, 0), proc(11, 1), proc(12, 11), proc(20, 1)];
        assert_eq!(pids(&descendants(&orphaned, &[10, 11])), [12]);
    }

    /// `iadeep run` (5) adopted the job's orphan (30, started after the job) but not
    /// the monitor (7) its shell started before `exec iadeep run`, nor the monitor's
    /// child; a zombie is still listed (it is reaped, not signalled).
    #[test]
    fn what_is_adopted_from_the_job_started_with_it_or_later() {
        let at = |pid, ppid, start| Proc {
            pid,
            ppid,
            start,
            zombie: false,
        };
        let adopter = Adopter { pid: 5, since: 100 };
        let table = [
            at(5, 1, 50),
            at(7, 5, 60),
            at(8, 7, 120),
            at(10, 5, 100),
            at(30, 5, 130),
            at(31, 30, 131),
        ];
        let adopted: Vec<i32> = adopter.adopted(&table).map(|p| p.pid).collect();
        assert_eq!(adopted, [10, 30]);
    }

    /// A table read while processes come and go may show a loop: each process once.
    #[test]
    fn an_inconsistent_table_does_not_loop() {
        let table = [proc(10, 11), proc(11, 10), proc(12, 11)];
        assert_eq!(pids(&descendants(&table, &[10])), [11, 12]);
    }

    #[test]
    fn a_stat_line_names_the_parent_the_start_and_a_zombie() {
        let line = "4242 (my (odd) name) S 4200 4242 4200 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 \
                    1 0 987654 1000 100 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(Proc {
                pid: 4242,
                ppid: 4200,
                start: 987654,
                zombie: false
            })
        );
        let zombie = line.replace(") S ", ") Z ");
        assert!(parse_stat(&zombie).is_some_and(|p| p.zombie));
        assert_eq!(parse_stat("4242 (cut"), None);
    }

    /// This test's own process is in the table /proc gives, under its parent.
    #[test]
    fn proc_lists_this_process() {
        let me = std::process::id() as i32;
        let table = processes();
        let mine = table.iter().find(|p| p.pid == me).expect("this process");
        assert_eq!(mine.ppid, std::os::unix::process::parent_id() as i32);
        assert!(!mine.zombie);
    }
}
