//! `wrap.threads_per_replica`: several replicas of the model on one rank's threads. The rank's
//! own replica computes the first part of every batch on its thread; each other replica is a
//! model built again whose parameters share the first one's data (so the optimizer's updates
//! reach them) but keep their own gradients, and computes its part on a thread of its own.
//! After the backward passes the other replicas' gradients are added to the first one's in
//! replica order: the same sums, in the same order, as `train.accumulate` over the same parts.
//! Validation's forward pass is split over the replicas the same way.
//!
//! Small models gain: a product of 768 rows by 128 columns is too short to keep two threads
//! busy (they wait for each other at every operation), while two products of 384 rows on one
//! thread each do not wait at all.
use std::ops::Range;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tch::nn::{self, ModuleT};
use tch::Tensor;

use crate::config::schema::Precision;
use crate::data::Task;
use crate::model::{Architecture, BuildContext};

/// One part of a batch, computed by a replica: each row's loss and whether it was predicted.
pub struct Part {
    pub per_sample: Tensor,
    pub correct: Tensor,
}

/// What a replica is asked to compute.
enum Job {
    /// A training step's part: its rows, and its share of the step's mean loss.
    Step { x: Tensor, y: Tensor, scale: f64 },
    /// A forward pass in evaluation mode, without gradients (validation's part).
    Forward { x: Tensor },
}

enum Done {
    Step(Part),
    Forward(Tensor),
}

/// A replica computing on its own thread.
struct Worker {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Result<Done, String>>,
    /// Its parameters in module order: the first replica's data, its own gradients.
    params: Vec<Tensor>,
    thread: Option<JoinHandle<()>>,
}

/// The replicas after the rank's own.
pub struct ThreadReplicas {
    workers: Vec<Worker>,
}

impl ThreadReplicas {
    /// `replicas - 1` more replicas of layers `layers` of `arch`, sharing the data of `params`
    /// (the rank's replica's parameters, in module order), each computing on `threads` threads
    /// (as the rank's thread does).
    pub fn new(
        arch: &dyn Architecture,
        layers: Range<usize>,
        params: &[Tensor],
        replicas: usize,
        threads: usize,
        task: Task,
        precision: Precision,
    ) -> anyhow::Result<ThreadReplicas> {
        let mut workers = Vec::new();
        for k in 1..replicas {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            // Weights from any seed: they are replaced by the rank's replica's data below.
            let model = arch.build(&vs.root(), layers.clone(), &BuildContext::new(0));
            let mine = crate::model::parameters_in_module_order(arch, layers.clone(), &vs);
            anyhow::ensure!(
                mine.len() == params.len(),
                "a thread replica has {} parameters, not {}",
                mine.len(),
                params.len()
            );
            for (mut q, p) in mine.iter().map(Tensor::shallow_clone).zip(params) {
                // The same storage, its own gradient (torch's `q.data = p.data`).
                q.set_data(&p.detach());
            }
            let (jobs, inbox) = mpsc::channel::<Job>();
            let (outbox, done) = mpsc::channel();
            let thread = std::thread::Builder::new().name(format!("replica-{k}")).spawn(move || {
                tch::set_num_threads(threads as i32);
                for job in inbox {
                    let done = compute(model.as_ref(), task, precision, job);
                    if outbox.send(done).is_err() {
                        break;
                    }
                }
            })?;
            workers.push(Worker { jobs: Some(jobs), done, params: mine, thread: Some(thread) });
        }
        Ok(ThreadReplicas { workers })
    }

    /// Replicas in all, the rank's own included.
    pub fn count(&self) -> usize {
        self.workers.len() + 1
    }

    /// Forward, loss and backward of a batch split over the replicas: `first` computes the first
    /// part on this thread (its rows, and their share of the loss) while the other replicas
    /// compute theirs; then their gradients are added to `params`' (the rank's replica's), in
    /// replica order. Returns every row's loss and correctness, in the batch's order.
    pub fn step(
        &mut self,
        params: &[Tensor],
        x: &Tensor,
        y: &Tensor,
        scale: f64,
        first: impl FnOnce(&Tensor, &Tensor, f64) -> anyhow::Result<Part>,
    ) -> anyhow::Result<Part> {
        let n = x.size()[0];
        let sizes = super::pipeline::micro_sizes(n, self.count());
        let share = |rows: i64| if sizes.len() == 1 { scale } else { scale * rows as f64 / n as f64 };
        let mut at = sizes[0];
        let busy = sizes.len() - 1;
        for (w, &rows) in self.workers.iter().zip(&sizes[1..]) {
            w.send(Job::Step { x: x.narrow(0, at, rows), y: y.narrow(0, at, rows), scale: share(rows) })?;
            at += rows;
        }
        let mine = first(&x.narrow(0, 0, sizes[0]), &y.narrow(0, 0, sizes[0]), share(sizes[0]));
        // Every busy replica's answer is taken, even after a failure here, so none is left
        // computing into gradients the next step would read.
        let theirs: Vec<_> = self.workers[..busy].iter().map(Worker::receive).collect();
        let mut parts = vec![mine?];
        for done in theirs {
            match done? {
                Done::Step(part) => parts.push(part),
                Done::Forward(_) => unreachable!("a step's answer"),
            }
        }
        tch::no_grad(|| -> anyhow::Result<()> {
            for w in &self.workers[..busy] {
                for (p, q) in params.iter().zip(&w.params) {
                    let (mut g, h) = (p.grad(), q.grad());
                    match (g.defined(), h.defined()) {
                        (true, true) => _ = g.g_add_(&h),
                        (false, false) => {}
                        _ => anyhow::bail!("a parameter has a gradient in one thread replica and not in another"),
                    }
                }
                crate::dist::clear_grads(&w.params)?;
            }
            Ok(())
        })?;
        let cat = |f: fn(&Part) -> &Tensor| Tensor::cat(&parts.iter().map(f).collect::<Vec<_>>(), 0);
        Ok(Part { per_sample: cat(|p| &p.per_sample), correct: cat(|p| &p.correct) })
    }
}

impl ThreadReplicas {
    /// The model's output on `x` in evaluation mode, its rows split over the replicas as a
    /// training batch's: `first` computes the first part on this thread.
    pub fn forward(&self, x: &Tensor, first: impl FnOnce(&Tensor) -> Tensor) -> anyhow::Result<Tensor> {
        let sizes = super::pipeline::micro_sizes(x.size()[0], self.count());
        let mut at = sizes[0];
        for (w, &rows) in self.workers.iter().zip(&sizes[1..]) {
            w.send(Job::Forward { x: x.narrow(0, at, rows) })?;
            at += rows;
        }
        let mine = first(&x.narrow(0, 0, sizes[0]));
        let mut outs = vec![mine];
        for w in &self.workers[..sizes.len() - 1] {
            match w.receive()? {
                Done::Forward(out) => outs.push(out),
                Done::Step(_) => unreachable!("a forward pass's answer"),
            }
        }
        Ok(Tensor::cat(&outs, 0))
    }
}

impl Worker {
    fn send(&self, job: Job) -> anyhow::Result<()> {
        self.jobs.as_ref().expect("open until dropped").send(job).map_err(|_| stopped())
    }

    fn receive(&self) -> anyhow::Result<Done> {
        let done = self.done.recv().map_err(|_| stopped())?;
        done.map_err(|e| anyhow::anyhow!("a thread replica failed: {e}"))
    }
}

impl Drop for ThreadReplicas {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.jobs = None;
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn stopped() -> anyhow::Error {
    anyhow::anyhow!("a thread replica stopped (its thread panicked); see the message above")
}

/// One replica's forward, loss and backward over a part of a batch; `forward`: how long the
/// forward pass took.
pub fn forward_backward(
    model: &dyn ModuleT,
    task: Task,
    precision: Precision,
    x: &Tensor,
    y: &Tensor,
    scale: f64,
    forward: &mut std::time::Duration,
) -> anyhow::Result<(Tensor, Tensor)> {
    let start = std::time::Instant::now();
    let out = super::forward_float(precision, model, x)?;
    *forward = start.elapsed();
    let (per_sample, loss) = super::scaled_loss(task, &out, y, scale);
    loss.f_backward()?;
    Ok((per_sample.detach(), tch::no_grad(|| task.correct(&out, y))))
}

fn compute(model: &dyn ModuleT, task: Task, precision: Precision, job: Job) -> Result<Done, String> {
    match job {
        Job::Step { x, y, scale } => forward_backward(model, task, precision, &x, &y, scale, &mut Default::default())
            .map(|(per_sample, correct)| Done::Step(Part { per_sample, correct }))
            .map_err(|e| e.to_string()),
        Job::Forward { x } => Ok(Done::Forward(tch::no_grad(|| model.forward_t(&x, false)))),
    }
}
