//! One stack per e2e module in one test binary: started by the module's first test that asks for
//! it, shared by the module's tests, and stopped once they are done, so that the modules' stacks
//! do not pile up in the one process (an idle stack is about 200 MB and 1.5 % of a core: Envoy,
//! the companion, PostgreSQL).
//!
//! "Done" needs no list of the module's tests. libtest starts tests in name order
//! (`module::test`), so once a test of another module asks for its stack, every test of this
//! module has started; and libtest runs each test on a thread of its own, so a test that got a
//! module's stack holds a lease on it until its thread ends. A module's stack stops once another
//! module has asked since it started and no lease on it is left, both for `GRACE` (10 s): a test
//! that started before the other module asked may still be building its request. Should a test
//! of a stopped module still ask (later than that, or in a shuffled order), the stack starts
//! again: the test is still right, only slower.
//!
//! At most [`Gate::limit`] module stacks are starting, up or stopping at once
//! (`MAAS_E2E_STACKS`, default 3: two test threads on two cores, plus one stopping); a module
//! that would exceed it stops the stacks that are done without waiting out their grace, or
//! waits for one to stop.

use std::any::Any;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, Location};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError, mpsc};
use std::time::{Duration, Instant};

/// What a module keeps running for its tests.
pub trait Stoppable: Send + Sync + 'static {
    /// Stops its processes. The value stays allocated (its tests held `&'static` references to
    /// it) and is not used again.
    fn stop(&self);
}

impl Stoppable for crate::Stack {
    fn stop(&self) {
        self.shutdown();
    }
}

/// A module's stack: `static S: ModuleStack<Stack> = ModuleStack::new();` in the module, then
/// [`ModuleStack::get_or_start`] in its `stack()`.
pub struct ModuleStack<T> {
    /// Not zero-sized: the static's address is the module's key.
    _key: u8,
    _value: PhantomData<fn() -> T>,
}

impl<T: Stoppable> Default for ModuleStack<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Stoppable> ModuleStack<T> {
    pub const fn new() -> Self {
        ModuleStack {
            _key: 0,
            _value: PhantomData,
        }
    }

    /// The module's running stack, started with `start` when there is none (the first time, or
    /// again after it stopped); the calling thread holds a lease on it until it ends. Panics
    /// when the start failed (then for every later test of the module too, without trying
    /// again).
    #[track_caller]
    pub fn get_or_start(&'static self, start: impl FnOnce() -> Result<T, String>) -> &'static T {
        self.get_or_start_in(gate(), start)
    }

    /// As [`ModuleStack::get_or_start`], under `gate`.
    #[track_caller]
    pub fn get_or_start_in(
        &'static self,
        gate: &'static Gate,
        start: impl FnOnce() -> Result<T, String>,
    ) -> &'static T {
        let key = std::ptr::from_ref(self) as usize;
        gate.get(key, Location::caller().file(), start)
    }
}

/// How long a module's stack stays up once its tests look done: a test that started before
/// another module asked may still be building its request (a 440 kB body takes a while in a
/// debug build) before it asks.
const GRACE: Duration = Duration::from_secs(10);

/// The process's gate, for every module.
fn gate() -> &'static Gate {
    static GATE: Gate = Gate::new(None, GRACE);
    &GATE
}

type Erased = &'static (dyn Any + Send + Sync);

enum State {
    Starting,
    Up {
        value: Erased,
        stop: fn(Erased),
        leases: usize,
        /// When the last lease ended (`None` while a test holds one).
        idle_since: Option<Instant>,
        /// When another module first asked for its stack since this one started.
        passed_at: Option<Instant>,
    },
    Stopping,
    Stopped,
    Failed(String),
}

impl State {
    /// Up, and the module's tests are done: another module asked, none holds it, and both for
    /// `grace` (a test that started before the other module asked may not have asked yet).
    fn done(&self, now: Instant, grace: Duration) -> bool {
        match self {
            State::Up {
                leases: 0,
                idle_since: Some(idle),
                passed_at: Some(passed),
                ..
            } => now >= (*idle).max(*passed) + grace,
            _ => false,
        }
    }
}

struct Entry {
    name: &'static str,
    state: State,
    starts: usize,
}

#[derive(Default)]
struct Inner {
    entries: BTreeMap<usize, Entry>,
    /// Stacks starting, up or stopping.
    alive: usize,
}

/// How long a module waits for its stack (another module's start or stop, a free place) before
/// it fails saying what it waited for.
const WAIT_LIMIT: Duration = Duration::from_secs(30 * 60);

/// How often the stopper looks for module stacks that are done.
const TICK: Duration = Duration::from_millis(100);

/// The module stacks of one process (tests make their own).
pub struct Gate {
    limit: Option<usize>,
    /// How long a stack whose tests look done stays up in case one more asks.
    grace: Duration,
    inner: Mutex<Option<Inner>>,
    changed: Condvar,
    stopper: OnceLock<Mutex<mpsc::Sender<Job>>>,
}

struct Job {
    key: usize,
    name: &'static str,
    value: Erased,
    stop: fn(Erased),
}

impl Job {
    fn run(self, gate: &Gate) {
        eprintln!("{}: its tests are done; stopping its stack", self.name);
        (self.stop)(self.value);
        let mut guard = gate.lock();
        if let Some(inner) = guard.as_mut() {
            if let Some(entry) = inner.entries.get_mut(&self.key) {
                entry.state = State::Stopped;
            }
            inner.alive -= 1;
        }
        drop(guard);
        gate.changed.notify_all();
    }
}

impl Gate {
    /// `limit` module stacks at once (`None`: `MAAS_E2E_STACKS`, default 3); one whose tests
    /// look done stops after `grace`, or at once when another module waits for a place.
    pub const fn new(limit: Option<usize>, grace: Duration) -> Self {
        Gate {
            limit,
            grace,
            inner: Mutex::new(None),
            changed: Condvar::new(),
            stopper: OnceLock::new(),
        }
    }

    /// How many module stacks may be starting, up or stopping at once (at least 1).
    pub fn limit(&self) -> usize {
        static FROM_ENV: OnceLock<usize> = OnceLock::new();
        let limit = self.limit.unwrap_or_else(|| {
            *FROM_ENV.get_or_init(|| {
                std::env::var("MAAS_E2E_STACKS")
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(3)
            })
        });
        limit.max(1)
    }

    fn lock(&self) -> MutexGuard<'_, Option<Inner>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn get<T: Stoppable>(
        &'static self,
        key: usize,
        name: &'static str,
        start: impl FnOnce() -> Result<T, String>,
    ) -> &'static T {
        let stopper = self.stopper();
        let deadline = Instant::now() + WAIT_LIMIT;
        let mut guard = self.lock();
        loop {
            let inner = guard.get_or_insert_with(Inner::default);
            pass_others(inner, key);
            let limit = self.limit();
            let entry = inner.entries.entry(key).or_insert(Entry {
                name,
                state: State::Stopped,
                starts: 0,
            });
            match &mut entry.state {
                State::Up {
                    value,
                    leases,
                    idle_since,
                    ..
                } => {
                    if take_lease(self, key) {
                        *leases += 1;
                        *idle_since = None;
                    }
                    let value = *value;
                    drop(guard);
                    return downcast(value, name);
                }
                State::Failed(e) => {
                    let e = e.clone();
                    drop(guard);
                    panic!("{name}: the module's stack did not start: {e}");
                }
                State::Stopped if inner.alive < limit => {
                    entry.state = State::Starting;
                    entry.starts += 1;
                    inner.alive += 1;
                    let again = entry.starts > 1;
                    drop(guard);
                    return self.start(key, name, again, start);
                }
                State::Stopped => {
                    // No place: the stacks whose tests look done stop now, not after the grace.
                    let tx = stopper.lock().unwrap_or_else(PoisonError::into_inner);
                    for job in inner.take_done(Instant::now(), Duration::ZERO) {
                        let _ = tx.send(job);
                    }
                    drop(tx);
                    guard = self.wait(guard, deadline, name);
                }
                State::Starting | State::Stopping => {
                    guard = self.wait(guard, deadline, name);
                }
            }
        }
    }

    /// Starts a module's stack (its entry is `Starting`, counted as alive).
    fn start<T: Stoppable>(
        &'static self,
        key: usize,
        name: &'static str,
        again: bool,
        start: impl FnOnce() -> Result<T, String>,
    ) -> &'static T {
        if again {
            eprintln!("{name}: its stack had stopped and starts again (a test asked late)");
        }
        let started = std::panic::catch_unwind(AssertUnwindSafe(start))
            .unwrap_or_else(|_| Err("starting it panicked".into()));
        let mut guard = self.lock();
        let inner = guard.get_or_insert_with(Inner::default);
        let Some(entry) = inner.entries.get_mut(&key) else {
            unreachable!("a starting module's entry is kept")
        };
        let outcome = match started {
            Ok(value) => {
                let value: &'static T = Box::leak(Box::new(value));
                let leased = take_lease(self, key);
                entry.state = State::Up {
                    value,
                    stop: stop_erased::<T>,
                    leases: usize::from(leased),
                    idle_since: (!leased).then(Instant::now),
                    passed_at: None,
                };
                Ok(value)
            }
            Err(e) => {
                entry.state = State::Failed(e.clone());
                inner.alive -= 1;
                Err(e)
            }
        };
        drop(guard);
        self.changed.notify_all();
        outcome.unwrap_or_else(|e| panic!("{name}: the module's stack did not start: {e}"))
    }

    /// A thread that held a lease on `key` ended.
    fn release(&self, key: usize) {
        let mut guard = self.lock();
        let entry = guard.as_mut().and_then(|inner| inner.entries.get_mut(&key));
        if let Some(Entry {
            state: State::Up {
                leases, idle_since, ..
            },
            ..
        }) = entry
        {
            *leases = leases.saturating_sub(1);
            if *leases == 0 {
                *idle_since = Some(Instant::now());
            }
        }
    }

    /// The thread that stops module stacks once they are done: off the test threads (libtest
    /// waits for a test's thread to end) and started from `get`, never from a thread's exit.
    fn stopper(&'static self) -> &'static Mutex<mpsc::Sender<Job>> {
        self.stopper.get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name("maas-module-stack-stopper".into())
                .spawn(move || {
                    loop {
                        match rx.recv_timeout(TICK) {
                            Ok(job) => job.run(self),
                            Err(mpsc::RecvTimeoutError::Timeout) => {}
                            Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        }
                        let done = match self.lock().as_mut() {
                            Some(inner) => inner.take_done(Instant::now(), self.grace),
                            None => Vec::new(),
                        };
                        for job in done {
                            job.run(self);
                        }
                    }
                })
                .expect("the stopper thread starts");
            Mutex::new(tx)
        })
    }

    fn wait<'a>(
        &self,
        guard: MutexGuard<'a, Option<Inner>>,
        deadline: Instant,
        name: &str,
    ) -> MutexGuard<'a, Option<Inner>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let states = guard.as_ref().map(Inner::describe).unwrap_or_default();
            drop(guard);
            panic!("{name}: no module stack for {WAIT_LIMIT:?}; module stacks: {states}");
        }
        self.changed
            .wait_timeout(guard, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }
}

/// Another module (`key`) asks: every other module's stack has been passed.
fn pass_others(inner: &mut Inner, key: usize) {
    for (&other, entry) in &mut inner.entries {
        if let State::Up { passed_at, .. } = &mut entry.state
            && other != key
            && passed_at.is_none()
        {
            *passed_at = Some(Instant::now());
        }
    }
}

impl Inner {
    /// The stacks [`State::done`] for `grace`, now `Stopping` (still counted as alive).
    fn take_done(&mut self, now: Instant, grace: Duration) -> Vec<Job> {
        let mut jobs = Vec::new();
        for (&key, entry) in &mut self.entries {
            if !entry.state.done(now, grace) {
                continue;
            }
            if let State::Up { value, stop, .. } =
                std::mem::replace(&mut entry.state, State::Stopping)
            {
                jobs.push(Job {
                    key,
                    name: entry.name,
                    value,
                    stop,
                });
            }
        }
        jobs
    }

    fn describe(&self) -> String {
        self.entries
            .values()
            .map(|e| {
                let state = match &e.state {
                    State::Starting => "starting".to_string(),
                    State::Up {
                        leases, passed_at, ..
                    } => format!("up ({leases} tests, passed: {})", passed_at.is_some()),
                    State::Stopping => "stopping".to_string(),
                    State::Stopped => "stopped".to_string(),
                    State::Failed(_) => "failed".to_string(),
                };
                format!("{} {state}", e.name)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn stop_erased<T: Stoppable>(value: Erased) {
    if let Some(value) = value.downcast_ref::<T>() {
        value.stop();
    }
}

fn downcast<T: Stoppable>(value: Erased, name: &str) -> &'static T {
    value
        .downcast_ref::<T>()
        .unwrap_or_else(|| panic!("{name}: one module stack holds one type"))
}

/// The module stacks this thread holds, released when it ends.
struct Leases(Cell<Vec<(&'static Gate, usize)>>);

impl Drop for Leases {
    fn drop(&mut self) {
        for (gate, key) in self.0.get_mut().drain(..) {
            gate.release(key);
        }
    }
}

thread_local! {
    static LEASES: Leases = const { Leases(Cell::new(Vec::new())) };
}

/// Records that this thread holds `key`; false when it already did.
fn take_lease(gate: &'static Gate, key: usize) -> bool {
    LEASES
        .try_with(|leases| {
            let mut held = leases.0.take();
            let new = !held.iter().any(|&(g, k)| std::ptr::eq(g, gate) && k == key);
            if new {
                held.push((gate, key));
            }
            leases.0.set(held);
            new
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests;
