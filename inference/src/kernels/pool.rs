//! The forward pass's own worker threads: one parallel pass hands out task indices to the
//! caller and to workers that stay awake between passes, as llama.cpp's threads spin at their
//! barriers, instead of rayon's, which sleep within ~50 us of running dry.
//!
//! A decode token runs ~100 short passes (each layer's projections, experts, heads) with
//! serial work between them (norms, routing, softmax). On this project's 2-core VMs a rayon
//! pass whose other thread had gone to sleep took ~10 us instead of ~1.6 us (futex wake-up and
//! a virtual IPI), and scheduler and futex time was ~6% of a decode profile. Here a worker
//! spins briefly, then yields (so that I/O threads hashing landed experts still get the core),
//! and parks only after [`IDLE_BEFORE_PARK`] without a pass, or right after each pass while
//! the forward reads from drives ([`Pool::park_between_passes`]).
//!
//! One pass at a time: a pass started while another is running (from a task, or from a second
//! thread) runs its tasks on the calling thread. A panicking task is re-raised on the caller
//! once every task of its pass has finished.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Busy-wait with `spin_loop` this long after a pass before yielding.
const SPIN: Duration = Duration::from_micros(50);
/// Yield this long after a pass before parking.
const IDLE_BEFORE_PARK: Duration = Duration::from_millis(3);

/// A pass's tasks, type-erased: `call(data, i)` runs task `i`.
#[derive(Clone, Copy)]
struct Job {
    data: *const (),
    call: unsafe fn(*const (), usize),
    tasks: usize,
}

struct Shared {
    /// Generation (high 32 bits) and next task index (low 32 bits): claiming a task checks
    /// the generation in the same compare-and-swap, so a worker that looked at an old pass
    /// can never run a new pass's task with the old pass's closure.
    next: AtomicU64,
    /// The current pass; written only while no task of the previous pass is unfinished.
    job: UnsafeCell<Job>,
    done: AtomicUsize,
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Set while a pass runs.
    busy: AtomicBool,
    sleeping: AtomicUsize,
    /// Set by [`Pool::rest`] until the next pass: idle workers park at once.
    resting: AtomicBool,
    /// Set by [`Pool::park_between_passes`] until cleared: idle workers park at once after
    /// every pass.
    park_between: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

// SAFETY: `job` is written by the one caller holding `busy` while no task of the previous pass
// is outstanding, and read by workers only before they claim a task of that pass, which the
// generation check in `next` validates (see `Shared::next`). The closure behind it is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer in `Job` is only dereferenced under that protocol.
unsafe impl Send for Shared {}

fn pack(generation: u64, index: u64) -> u64 {
    (generation << 32) | index
}

/// The task index of a generation whose job is being written: no task can be claimed.
const CLOSED: u64 = 0xffff_ffff;

impl Shared {
    /// Claim and run tasks of generation `generation` until none are left.
    fn work(&self, generation: u64) {
        loop {
            let cur = self.next.load(Ordering::Acquire);
            if cur >> 32 != generation {
                return;
            }
            // SAFETY: `job` holds this generation's pass: it is rewritten only after every
            // task of this generation finished, and if that happened the claim below fails.
            let job = unsafe { *self.job.get() };
            let i = cur & 0xffff_ffff;
            if i as usize >= job.tasks {
                return;
            }
            if self
                .next
                .compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: task `i` of the live pass `job` was claimed by this thread alone; the
            // caller keeps the closure alive until `done` counts every task.
            let r = catch_unwind(AssertUnwindSafe(|| unsafe {
                (job.call)(job.data, i as usize)
            }));
            if let Err(p) = r {
                let mut slot = self.panicked.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn worker(self: Arc<Self>) {
        let mut seen = 0u64;
        let mut idle_since = Instant::now();
        loop {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let cur = self.next.load(Ordering::Acquire);
            let generation = cur >> 32;
            if generation != seen && cur & CLOSED != CLOSED {
                seen = generation;
                self.work(generation);
                idle_since = Instant::now();
                continue;
            }
            let idle = idle_since.elapsed();
            let resting =
                self.resting.load(Ordering::Relaxed) || self.park_between.load(Ordering::Relaxed);
            if idle < SPIN && !resting {
                std::hint::spin_loop();
            } else if idle < IDLE_BEFORE_PARK && !resting {
                std::thread::yield_now();
            } else {
                let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.sleeping.fetch_add(1, Ordering::SeqCst);
                while self.next.load(Ordering::SeqCst) >> 32 == seen
                    && !self.stop.load(Ordering::SeqCst)
                {
                    g = self.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                self.sleeping.fetch_sub(1, Ordering::SeqCst);
                drop(g);
                idle_since = Instant::now();
            }
        }
    }
}

/// The pool (see the module docs).
pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Pool {
    /// A pool of `threads` threads in all: the caller and `threads - 1` workers.
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            next: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                data: std::ptr::null(),
                call: noop,
                tasks: 0,
            }),
            done: AtomicUsize::new(0),
            panicked: Mutex::new(None),
            busy: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            resting: AtomicBool::new(false),
            park_between: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        for i in 1..threads.max(1) {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("deltafin-compute-{i}"))
                .spawn(move || s.worker());
            if spawned.is_err() {
                // Fewer workers: the passes still complete (the caller runs what is left).
                break;
            }
        }
        Pool {
            shared,
            threads: threads.max(1),
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f(i)` for every `i < tasks`, on the caller and the workers; returns when all ran.
    pub fn run<F: Fn(usize) + Sync>(&self, tasks: usize, f: F) {
        if tasks == 0 {
            return;
        }
        let s = &*self.shared;
        if tasks == 1
            || self.threads == 1
            || tasks >= CLOSED as usize
            || s.busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            (0..tasks).for_each(f);
            return;
        }
        unsafe fn call<F: Fn(usize)>(data: *const (), i: usize) {
            // SAFETY: `data` is the `&F` `run` published, alive until its pass is done.
            unsafe { (*(data as *const F))(i) }
        }
        // Never 0 again (what a new worker has seen).
        let generation = match (s.next.load(Ordering::Acquire) >> 32).wrapping_add(1) & 0xffff_ffff
        {
            0 => 1,
            g => g,
        };
        // Close the old generation before rewriting `job`: a worker that read the old
        // generation with its tasks all claimed, then reads the new job (more tasks), would
        // otherwise claim (old generation, next index) successfully, run a task of the new
        // pass before it is published and count it in `done` twice, so that `run` could
        // return before the last task had written its output (seen as flaky wrong tokens).
        s.next.store(pack(generation, CLOSED), Ordering::SeqCst);
        // SAFETY: `busy` is ours and the previous pass is complete (its `run` waited for
        // every task), so no thread reads `job` for a task it may still claim: claims of the
        // old generation fail from here on, and of the new one only after it is published.
        unsafe {
            *s.job.get() = Job {
                data: &f as *const F as *const (),
                call: call::<F>,
                tasks,
            };
        }
        s.done.store(0, Ordering::Release);
        s.resting.store(false, Ordering::Relaxed);
        s.next.store(pack(generation, 0), Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        s.work(generation);
        while s.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        let panicked = s.panicked.lock().unwrap_or_else(|e| e.into_inner()).take();
        s.busy.store(false, Ordering::Release);
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }

    /// The caller is about to block (waiting for a drive): idle workers park now instead of
    /// yielding for up to [`IDLE_BEFORE_PARK`]. At a memory cap a decode token waits for
    /// reads ~100 times; yielding workers were a third of a profile's samples there
    /// (sched_yield, clock reads) on 2 cores the I/O threads need for hashing and completions.
    /// The next pass wakes them.
    pub fn rest(&self) {
        self.shared.resting.store(true, Ordering::Relaxed);
    }

    /// While `on`, idle workers park right after each pass instead of spinning and yielding
    /// (for [`IDLE_BEFORE_PARK`]) until the next. For the passes between a forward's waits
    /// on drives: the I/O threads (hashing, completions) and the drive itself need the cores
    /// then, and a spinning or yielding worker held one. At a 40% memory cap, paired over
    /// 10 alternated rounds, INT4 decoded in 0.989 of the time (Q8, whose cores are mostly
    /// idle there: 1.003; `benches/results/q8_kernel_session33.txt`). Not in RAM: a parked
    /// worker's wake-up costs a pass several microseconds.
    pub fn park_between_passes(&self, on: bool) {
        self.shared.park_between.store(on, Ordering::Relaxed);
    }

    /// `f(i, &mut items[i])` for every item, in parallel.
    pub fn for_each_mut<T: Send, F: Fn(usize, &mut T) + Sync>(&self, items: &mut [T], f: F) {
        let base = SendPtr(items.as_mut_ptr());
        let n = items.len();
        self.run(n, |i| {
            let p = &base;
            // SAFETY: `i < n` and every index is handed to exactly one task, so each item is
            // borrowed mutably once; `items` outlives the pass.
            f(i, unsafe { &mut *p.0.add(i) })
        });
    }

    /// `[f(0), .., f(n - 1)]`, computed in parallel.
    pub fn map<R: Send, F: Fn(usize) -> R + Sync>(&self, n: usize, f: F) -> Vec<R> {
        let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
        self.for_each_mut(&mut out, |i, o| *o = Some(f(i)));
        out.into_iter().flatten().collect()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.wake.notify_all();
    }
}

unsafe fn noop(_: *const (), _: usize) {}

struct SendPtr<T>(*mut T);
// SAFETY: used only to hand disjoint items of a slice to the pass's tasks (`for_each_mut`).
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// The process's pool: as many threads as rayon's global pool (`RAYON_NUM_THREADS`, else the
/// CPUs).
pub fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(rayon::current_num_threads()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_in_every_pass() {
        let p = Pool::new(3);
        for n in [0usize, 1, 2, 5, 64, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                p.run(n, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
            }
        }
        let mut v = vec![0usize; 100];
        p.for_each_mut(&mut v, |i, x| *x = i * 2);
        assert!(v.iter().enumerate().all(|(i, &x)| x == 2 * i));
        assert_eq!(p.map(7, |i| i * i), vec![0, 1, 4, 9, 16, 25, 36]);
    }

    #[test]
    fn nested_and_concurrent_passes_complete() {
        let p = Arc::new(Pool::new(2));
        let total = AtomicUsize::new(0);
        p.run(4, |_| {
            // A pass inside a task runs on the calling thread.
            p.run(3, |_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let c = AtomicUsize::new(0);
                    for _ in 0..200 {
                        p.run(8, |_| {
                            c.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    c.load(Ordering::Relaxed)
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().expect("no panic"), 1600);
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_goes_on() {
        let p = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            p.run(16, |i| {
                assert!(i != 11, "task 11 fails");
            })
        }));
        assert!(r.is_err());
        let c = AtomicUsize::new(0);
        p.run(16, |_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 16);
    }

    #[test]
    fn parked_workers_wake_for_the_next_pass() {
        let p = Pool::new(2);
        p.run(2, |_| {});
        std::thread::sleep(IDLE_BEFORE_PARK + Duration::from_millis(20));
        let c = AtomicUsize::new(0);
        p.run(100, |_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 100);
    }

    /// How many of a pass's `n` tasks ran.
    fn tasks_run(p: &Pool, n: usize) -> usize {
        let c = AtomicUsize::new(0);
        p.run(n, |_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        c.load(Ordering::Relaxed)
    }

    /// The number of parked workers once it equals `n` (waiting up to 5 s), else what it is
    /// then.
    fn sleeping_settles_at(p: &Pool, n: usize) -> usize {
        let t = Instant::now();
        while p.shared.sleeping.load(Ordering::SeqCst) != n && t.elapsed() < Duration::from_secs(5)
        {
            std::thread::yield_now();
        }
        p.shared.sleeping.load(Ordering::SeqCst)
    }

    /// Workers told to park between passes do so after every pass, and every pass still runs
    /// all of its tasks; a pass wakes them.
    #[test]
    fn workers_parking_between_passes_run_every_pass() {
        let p = Pool::new(3);
        p.park_between_passes(true);
        for round in 0..2000usize {
            if round % 5 == 0 {
                std::thread::sleep(Duration::from_micros(round as u64 % 200));
            }
            assert_eq!(tasks_run(&p, 8), 8, "round {round}");
        }
        assert_eq!(sleeping_settles_at(&p, 2), 2, "parked after the last pass");
        p.park_between_passes(false);
        assert_eq!(tasks_run(&p, 4), 4);
        // Passes wake parked workers. Passes keep coming while this waits: a woken worker parks
        // again after `IDLE_BEFORE_PARK` without one, and under qemu (CI's aarch64 run) one
        // worker could re-park before the other had woken, so that the count never read 0
        // after a single pass. (That they stay awake between close passes is not checked.)
        let t = Instant::now();
        while p.shared.sleeping.load(Ordering::SeqCst) != 0 && t.elapsed() < Duration::from_secs(5)
        {
            assert_eq!(tasks_run(&p, 4), 4);
            std::thread::yield_now();
        }
        assert_eq!(
            p.shared.sleeping.load(Ordering::SeqCst),
            0,
            "woken by passes"
        );
    }

    /// Workers told to rest park, and every pass after a rest, at any moment of the parking,
    /// still runs all of its tasks (no lost wake-up).
    #[test]
    fn resting_workers_park_and_wake_for_every_pass() {
        let p = Pool::new(3);
        p.run(4, |_| {});
        p.rest();
        assert_eq!(sleeping_settles_at(&p, 2), 2);
        for round in 0..2000usize {
            if round % 2 == 0 {
                p.rest();
            }
            if round % 7 == 0 {
                std::thread::sleep(Duration::from_micros(round as u64 % 300));
            }
            assert_eq!(tasks_run(&p, 8), 8, "round {round}");
        }
    }
}
