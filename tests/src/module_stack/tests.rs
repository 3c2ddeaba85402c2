//! The gate with stand-in stacks that record when they start and stop; each test has its own
//! gate, and each "test" of a module is a thread of its own, as under libtest.

use super::*;
use std::sync::mpsc::{Receiver, Sender};

/// What happened, in order: "start a", "stop a", …
#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn push(&self, event: String) {
        self.0.lock().unwrap().push(event);
    }
    fn events(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    /// The events in order of name (for stops that run beside a start).
    fn sorted(&self) -> Vec<String> {
        let mut events = self.events();
        events.sort();
        events
    }
    /// Waits (up to 10 s) until `event` happened.
    fn wait_for(&self, event: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.events().iter().any(|e| e == event) {
            assert!(
                Instant::now() < deadline,
                "no {event:?}: {:?}",
                self.events()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

struct Fake {
    name: &'static str,
    log: &'static Log,
}

impl Stoppable for Fake {
    fn stop(&self) {
        self.log.push(format!("stop {}", self.name));
    }
}

struct Setup {
    gate: &'static Gate,
    log: &'static Log,
}

impl Setup {
    fn new(limit: usize, grace: Duration) -> Setup {
        Setup {
            gate: Box::leak(Box::new(Gate::new(Some(limit), grace))),
            log: Box::leak(Box::default()),
        }
    }

    /// A module's stack that starts as a [`Fake`] named `name`.
    fn get(&self, module: &'static ModuleStack<Fake>, name: &'static str) -> &'static Fake {
        let log = self.log;
        module.get_or_start_in(self.gate, move || {
            log.push(format!("start {name}"));
            Ok(Fake { name, log })
        })
    }

    /// One test of `module`: asks for its stack on a thread of its own, which then ends.
    fn test(&'static self, module: &'static ModuleStack<Fake>, name: &'static str) -> usize {
        std::thread::spawn(move || std::ptr::from_ref(self.get(module, name)) as usize)
            .join()
            .unwrap()
    }

    /// One test of `module` that runs until [`Running::end`].
    fn running(&'static self, module: &'static ModuleStack<Fake>, name: &'static str) -> Running {
        let (started_tx, started_rx) = mpsc::channel();
        let (end_tx, end_rx): (Sender<()>, Receiver<()>) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            self.get(module, name);
            started_tx.send(()).unwrap();
            end_rx.recv().ok();
        });
        started_rx.recv().unwrap();
        Running { end_tx, thread }
    }
}

struct Running {
    end_tx: Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Running {
    fn end(self) {
        self.end_tx.send(()).unwrap();
        self.thread.join().unwrap();
    }
}

fn setup(limit: usize) -> &'static Setup {
    Box::leak(Box::new(Setup::new(limit, Duration::ZERO)))
}

fn module() -> &'static ModuleStack<Fake> {
    Box::leak(Box::new(ModuleStack::new()))
}

#[test]
fn a_module_stack_starts_once_and_stays_up_for_its_next_test() {
    let (s, a) = (setup(3), module());
    let first = s.test(a, "a");
    std::thread::sleep(Duration::from_millis(100));
    let second = s.test(a, "a");
    assert_eq!(first, second);
    assert_eq!(s.log.events(), ["start a"]);
}

#[test]
fn a_module_stack_stops_once_another_module_asked_and_its_tests_are_done() {
    let (s, a, b) = (setup(3), module(), module());
    let running = s.running(a, "a");
    s.test(b, "b");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        s.log.events(),
        ["start a", "start b"],
        "a test still holds a"
    );
    running.end();
    s.log.wait_for("stop a");
    assert_eq!(s.log.events(), ["start a", "start b", "stop a"]);
}

#[test]
fn an_idle_module_stack_stops_when_another_module_asks() {
    let (s, a, b) = (setup(3), module(), module());
    s.test(a, "a");
    s.test(b, "b");
    s.log.wait_for("stop a");
    assert_eq!(s.log.sorted(), ["start a", "start b", "stop a"]);
}

#[test]
fn a_module_stack_stays_up_for_its_grace_once_another_module_asked() {
    let s: &'static Setup = Box::leak(Box::new(Setup::new(3, Duration::from_millis(600))));
    let (a, b) = (module(), module());
    let first = s.test(a, "a");
    s.test(b, "b");
    // A test of `a` that started before `b` asked and asks now, within the grace.
    let late = s.test(a, "a");
    assert_eq!(first, late, "the same stack");
    assert_eq!(s.log.events(), ["start a", "start b"]);
    s.log.wait_for("stop a");
}

#[test]
fn a_module_waiting_for_a_place_does_not_wait_out_the_grace() {
    let s: &'static Setup = Box::leak(Box::new(Setup::new(1, Duration::from_secs(600))));
    let (a, b) = (module(), module());
    s.test(a, "a");
    s.test(b, "b");
    assert_eq!(s.log.events(), ["start a", "stop a", "start b"]);
}

#[test]
fn no_more_than_the_limit_run_at_once() {
    let (s, a, b) = (setup(1), module(), module());
    let running = s.running(a, "a");
    let waiting = std::thread::spawn(move || s.test(b, "b"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.log.events(), ["start a"], "b waits while a runs");
    running.end();
    waiting.join().unwrap();
    assert_eq!(s.log.events(), ["start a", "stop a", "start b"]);
}

#[test]
fn a_stopped_module_stack_starts_again_when_a_test_asks_late() {
    let (s, a, b) = (setup(3), module(), module());
    let first = s.test(a, "a");
    s.test(b, "b");
    s.log.wait_for("stop a");
    let again = s.test(a, "a");
    assert_ne!(first, again, "a fresh stack");
    s.log.wait_for("stop b");
    assert_eq!(
        s.log.sorted(),
        ["start a", "start a", "start b", "stop a", "stop b"]
    );
}

#[test]
fn a_failed_start_fails_every_test_of_the_module_once_and_frees_its_place() {
    let (s, a, b) = (setup(1), module(), module());
    let fail = |start: fn() -> Result<Fake, String>| {
        let err = std::thread::spawn(move || {
            a.get_or_start_in(s.gate, start);
        })
        .join()
        .unwrap_err();
        err.downcast_ref::<String>().cloned().unwrap_or_default()
    };
    let first = fail(|| Err("port taken".into()));
    assert!(first.contains("did not start: port taken"), "{first}");
    let second = fail(|| panic!("started again"));
    assert!(second.contains("did not start: port taken"), "{second}");
    s.test(b, "b");
    assert_eq!(s.log.events(), ["start b"]);
}
