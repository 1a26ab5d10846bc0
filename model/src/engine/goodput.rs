//! The `goodput` verify length: speculate only as much as the measured costs of this engine
//! say pays, at the batch's current size.
//!
//! The confidence head says how likely each draft is to survive; what a draft slot *costs*
//! depends on the device, the model and the load: on a GPU a verify forward of a few rows per
//! sequence costs about one decode step at small batches (launch- and weight-bound) and grows
//! with the rows once the batch is large, while the drafter's pass is a fixed cost per step.
//! So this policy learns, online, what steps of each shape cost here ([`CostCurve`]s fed by
//! the engine's own decode-only steps) and how much of what the confidence head promises is
//! accepted ([`Acceptance`]), and each step picks the option with the most expected tokens per
//! second (SmartSpec's goodput):
//!
//! ```text
//!  before drafting:  plain rate n / T_plain(n)  vs  max over γ of
//!                    (n + m·E[accepted | γ]) / (T_draft(m) + T_verify(n + m·γ))
//!                    (and the whole-block round replayed from a graph, where one exists)
//!                    → no drafter pass at all when speculation would not pay
//!  after drafting:   the draft is paid; admit the r most likely slots (cumulative survival,
//!                    calibrated) maximising (n + Σ survival) / T_verify(n + r), r = 0 being a
//!                    plain step (T_plain(n)), or the graph round
//! ```
//!
//! With `FERRY_GOODPUT_PROMPTS=1` (opt-in until measured on a GPU; `Shape::prompt_rows` is 0
//! otherwise): when prompt rows wait to join the step (a closed loop at high concurrency admits a
//! prompt nearly every step), the step runs eagerly with them and the costs above are not the
//! step's: its decode part then costs `a + b·rows` ([`RowFit`], fitted to the steps that carried
//! prompts), and a graph round that leaves the prompts a forward of their own pays that forward's
//! intercept `a`. Only uniform rounds are offered there, of any width (the forward is eager, so no
//! graph limits them). The prompts' own `b·P` is left out of every option: the same prompt rows are
//! owed whatever this step verifies, and every token the loop serves brings the same prompt rows
//! with it, so the option with the most tokens per second of decode work is the one with the most
//! per second of all work. (Session 49: costed as decode-only rounds, the policy verified 6–8
//! drafts a sequence at 128 sequences, where fixed lengths of 3–4 served more.)
//!
//! `n` is the number of running sequences (each commits at least one token per step), `m` the
//! number that may draft. Unknown costs are measured, not guessed: while a shape has no
//! estimate the policy tries it (a plain step, or a round under the confidence rule), and now
//! and then it tries the option it has been avoiding, so estimates follow the load: after
//! [`EXPLORE_EVERY`] steps of the other kind *and* [`EXPLORE_RATIO`] times the avoided
//! option's own cost in time. The second rule bounds what exploring costs: on a GPU an
//! exploratory round (drafter pass and an eager verify forward) can cost a dozen plain steps of
//! a small model, and trying one every 64 steps took a fifth of the time (BENCHMARKS.md,
//! session 19). Everything here is pure bookkeeping over numbers the engine hands in: the unit
//! tests drive it with made-up costs.

/// Steps of one kind after which the policy may try the other once, to keep its estimate fresh.
pub(crate) const EXPLORE_EVERY: u32 = 64;

/// Time spent in steps of one kind, as a multiple of the other option's estimated cost, after
/// which the policy may try that option once: exploring costs at most ~1/`EXPLORE_RATIO` of the
/// time (2 %).
pub(crate) const EXPLORE_RATIO: f64 = 50.0;

/// Weight of a new observation in a cost estimate once it has a few.
const COST_ALPHA: f64 = 0.1;

/// Weight of a new round in the acceptance estimates.
const ACCEPT_ALPHA: f64 = 0.02;

/// Bins of [`SlotCalibration`] over a slot's predicted survival, [0, 1] in equal steps.
const SLOT_BINS: usize = 10;

/// Weight of a new slot outcome in its bin.
const SLOT_ALPHA: f64 = 0.02;

/// Outcomes (decayed weight) a bin needs before its own rate replaces the global calibration.
const SLOT_MIN_WEIGHT: f64 = 8.0;

/// Weight of a new step in [`RowFit`].
const FIT_ALPHA: f64 = 0.05;

/// Steps (decayed weight) [`RowFit`] needs before it speaks.
const FIT_MIN_WEIGHT: f64 = 8.0;

/// How widely the fitted steps' rows must spread (standard deviation over mean) before the fit
/// tells a slope from an intercept.
const FIT_MIN_SPREAD: f64 = 0.05;

/// Seconds of an eager step as an affine function of its rows, `a + b·rows`, fitted online
/// (decayed least squares) to the steps that carried prompts: `a` is what any eager forward
/// pays (weights read, launches, the host), `b` what each row adds. One line rather than a
/// [`CostCurve`]: such steps are nearly always large (a prompt chunk beside the batch), and
/// the decode part of one is priced at rows the curve never saw on their own.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowFit {
    /// Decayed sums: weight, Σrows, Σsecs, Σrows², Σrows·secs.
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl RowFit {
    /// A step of `rows` took `secs`. A first step that paid one-off costs (kernel compiles)
    /// gives way to a cheaper second; later ones count at most 3× the seconds per row seen so
    /// far.
    pub fn record(&mut self, rows: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let x = rows as f64;
        let per_row = (self.x > 0.0).then(|| self.y / self.x);
        if self.w <= 1.0 && per_row.is_some_and(|r| secs / x < r) {
            *self = Self::default();
        }
        let secs = match per_row {
            Some(r) if self.w > 1.0 => secs.min(3.0 * r * x),
            _ => secs,
        };
        let keep = 1.0 - FIT_ALPHA;
        self.w = self.w * keep + 1.0;
        self.x = self.x * keep + x;
        self.y = self.y * keep + secs;
        self.xx = self.xx * keep + x * x;
        self.xy = self.xy * keep + x * secs;
    }

    /// `(a, b)`, both at least 0, once [`FIT_MIN_WEIGHT`] steps whose rows spread by
    /// [`FIT_MIN_SPREAD`] were seen; `None` before.
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.w < FIT_MIN_WEIGHT {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if var.is_nan() || var <= (FIT_MIN_SPREAD * mx).powi(2) {
            return None;
        }
        let b = ((self.xy / self.w - mx * my) / var).max(0.0);
        let a = my - b * mx;
        // A line through negative seconds at zero rows: the steps are all rows, no intercept.
        Some(if a >= 0.0 { (a, b) } else { (0.0, my / mx) })
    }
}

/// One bucket of a [`CostCurve`]: the running mean of the sizes and seconds seen in it.
#[derive(Debug, Clone, Copy)]
struct Point {
    x: f64,
    secs: f64,
    seen: u32,
}

/// Seconds a step costs as a function of one size (sequences, or rows of a forward), learned
/// online: power-of-two buckets, each a running mean of (size, seconds); estimates interpolate
/// linearly between buckets, are flat below the smallest and grow in proportion above the
/// largest (pessimistic: an untried larger shape never looks cheap).
#[derive(Debug, Clone, Default)]
pub(crate) struct CostCurve {
    points: Vec<Option<Point>>,
}

fn bucket(x: usize) -> usize {
    (usize::BITS - x.max(1).leading_zeros() - 1) as usize
}

impl CostCurve {
    /// A step of `size` took `secs`. The first observation of a bucket is kept only until a
    /// cheaper second one arrives (a first step pays one-off costs: kernel compiles, graph
    /// captures); later ones move the mean by [`COST_ALPHA`], an outlier (over 3× the
    /// estimate) counting as 3×.
    pub fn record(&mut self, size: usize, secs: f64) {
        if size == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let b = bucket(size);
        if self.points.len() <= b {
            self.points.resize(b + 1, None);
        }
        let x = size as f64;
        self.points[b] = Some(match self.points[b] {
            None => Point { x, secs, seen: 1 },
            Some(p) if p.seen == 1 => {
                if secs < p.secs {
                    Point { x, secs, seen: 2 }
                } else {
                    Point { seen: 2, ..p }
                }
            }
            Some(p) => {
                let secs = secs.min(3.0 * p.secs);
                Point {
                    x: p.x + COST_ALPHA * (x - p.x),
                    secs: p.secs + COST_ALPHA * (secs - p.secs),
                    seen: p.seen.saturating_add(1),
                }
            }
        });
    }

    /// Whether `size` has an estimate of its own: a bucket measured at least twice (the first
    /// step of a shape may pay a graph capture), or such buckets on both sides.
    pub fn knows(&self, size: usize) -> bool {
        let b = bucket(size);
        let at = |i: usize| {
            self.points
                .get(i)
                .copied()
                .flatten()
                .is_some_and(|p| p.seen >= 2)
        };
        at(b) || ((0..b).any(at) && (b + 1..self.points.len()).any(at))
    }

    /// Whether any bucket has been measured at least twice.
    pub fn measured(&self) -> bool {
        self.points.iter().flatten().any(|p| p.seen >= 2)
    }

    /// The estimated seconds of a step of `size`, from buckets measured at least twice;
    /// `None` before that.
    pub fn estimate(&self, size: usize) -> Option<f64> {
        let x = size as f64;
        // Buckets are in increasing order of size, and so are their mean sizes.
        let mut below: Option<Point> = None;
        for p in self.points.iter().flatten().filter(|p| p.seen >= 2) {
            if x <= p.x {
                return Some(match below {
                    None => p.secs,
                    Some(a) => a.secs + (x - a.x) / (p.x - a.x) * (p.secs - a.secs),
                });
            }
            below = Some(*p);
        }
        below.map(|last| last.secs * x / last.x)
    }
}

/// What verification has accepted so far: per draft position the conditional acceptance
/// (a draft reached is accepted), and how the confidence head's promises compare with what
/// was accepted.
#[derive(Debug, Clone, Default)]
pub(crate) struct Acceptance {
    /// Position k (0-based): the running rate at which a reached draft is accepted (`None`
    /// before one is reached).
    conditional: Vec<Option<f64>>,
    /// Running sums of accepted drafts and of the survival the head predicted for them.
    accepted: f64,
    predicted: f64,
}

impl Acceptance {
    /// A round verified `gamma` drafts for which the head predicted `predicted` accepted in
    /// expectation (the sum of their cumulative survivals), and `accepted` were.
    pub fn record(&mut self, gamma: usize, accepted: usize, predicted: f64) {
        if gamma == 0 {
            return;
        }
        if self.conditional.len() < gamma {
            self.conditional.resize(gamma, None);
        }
        // Drafts 0..=accepted were reached (the last of them rejected unless all were taken).
        for k in 0..gamma.min(accepted + 1) {
            let hit = if k < accepted { 1.0 } else { 0.0 };
            let r = &mut self.conditional[k];
            *r = Some(r.map_or(hit, |v| v + ACCEPT_ALPHA * (hit - v)));
        }
        let decay = 1.0 - ACCEPT_ALPHA;
        self.accepted = self.accepted * decay + accepted as f64;
        self.predicted = self.predicted * decay + predicted.max(0.0);
    }

    /// Whether any round has been seen.
    pub fn known(&self) -> bool {
        self.conditional.first().is_some_and(Option::is_some)
    }

    /// The factor that turns the head's cumulative survival into the acceptance observed
    /// here (1 before any round; bounded so one bad stretch cannot switch speculation off
    /// for good).
    pub fn calibration(&self) -> f64 {
        if self.predicted < 1.0 {
            return 1.0;
        }
        (self.accepted / self.predicted).clamp(0.05, 2.0)
    }

    /// Expected accepted drafts of a sequence that verifies `gamma`: Σ_{k<γ} Π_{j≤k} a_j
    /// (positions never reached yet take the last known rate).
    pub fn expected(&self, gamma: usize) -> f64 {
        let mut reach = 1.0;
        let mut sum = 0.0;
        let mut last = 0.0;
        for k in 0..gamma {
            let a = self.conditional.get(k).copied().flatten().unwrap_or(last);
            last = a;
            reach *= a;
            sum += reach;
        }
        sum
    }
}

/// How often a draft slot the head gave a cumulative survival `p` was accepted, per bin of
/// `p` (a reliability diagram, learned online). One factor for all of the head's promises
/// ([`Acceptance::calibration`]) cannot fix a head that is wrong differently at different
/// confidences: session 38's trained pair under-predicted, and the `goodput` policy decoded
/// plainly after 288 of 1,950 drafter passes at batch 1 whose rounds, by the counts, would
/// have accepted as many drafts as the rest. Outcomes come from verified rounds and, for
/// greedy sequences, from drafts the policy did not verify (the tokens decoded after them say
/// exactly what verification would have accepted), so the low-confidence bins the policy
/// avoids are measured too.
#[derive(Debug, Clone, Default)]
pub(crate) struct SlotCalibration {
    /// Per bin: decayed (accepted, outcomes).
    bins: [(f64, f64); SLOT_BINS],
}

fn slot_bin(p: f32) -> usize {
    ((f64::from(p).clamp(0.0, 1.0) * SLOT_BINS as f64) as usize).min(SLOT_BINS - 1)
}

impl SlotCalibration {
    /// A draft slot of survival `p` was accepted (`hit`) or not.
    pub fn record(&mut self, p: f32, hit: bool) {
        if !p.is_finite() {
            return;
        }
        let (hits, n) = &mut self.bins[slot_bin(p)];
        let decay = 1.0 - SLOT_ALPHA;
        *hits = *hits * decay + f64::from(u8::from(hit));
        *n = *n * decay + 1.0;
    }

    /// The observed acceptance of slots like `p`, once its bin has enough outcomes.
    pub fn rate(&self, p: f32) -> Option<f64> {
        let (hits, n) = self.bins[slot_bin(p)];
        (n >= SLOT_MIN_WEIGHT).then(|| hits / n)
    }
}

/// The shape of a step the engine may run, for the policy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Running sequences (each commits at least one token).
    pub seqs: usize,
    /// Of those, the ones that may draft.
    pub eligible: usize,
    /// Drafts per sequence from one drafter pass.
    pub block: usize,
    /// Draft slots an eager round may verify (the step's verify budget).
    pub budget: usize,
    /// Bit γ set: a *uniform* round, every running sequence verifying its first γ drafts,
    /// would be replayed from a graph (bit `block`: the whole-block round). Only the widths
    /// of [`widths`] are offered.
    pub graph_widths: u32,
    /// The widest uniform round this step can run, every running sequence verifying as many
    /// drafts (0: none; on the CPU, or when a sequence does not draft).
    pub uniform: usize,
    /// Prompt rows waiting to join this step, priced (`FERRY_GOODPUT_PROMPTS=1`; else 0).
    pub prompt_rows: usize,
    /// Prompt work joins this step, priced or not: a round here is timed with it, so it
    /// teaches the decode-only curves nothing and is not run to explore them.
    pub beside_prompts: bool,
    /// Whether a graph round of at least `prompt_rows` drafts keeps its graph and leaves the
    /// prompts a forward of their own (`PromptSteps::Auto` on CUDA); otherwise the prompts join
    /// it and the step runs eagerly.
    pub splits: bool,
}

impl Shape {
    /// Whether a uniform round of `gamma` drafts per sequence is replayed from a graph.
    pub fn graphs(&self, gamma: usize) -> bool {
        gamma < 32 && self.graph_widths & (1 << gamma) != 0 && self.eligible == self.seqs
    }
}

/// The uniform round widths (drafts per sequence) a graph may be captured for: the powers of
/// two below the block, and the block. Each width is a graph per batch bucket, so the set is
/// kept small; at a large batch a narrower round verifies the most likely drafts of every
/// sequence for a fraction of the whole block's rows.
pub(crate) fn widths(block: usize) -> impl Iterator<Item = usize> {
    (0..usize::BITS)
        .map(|i| 1usize << i)
        .take_while(move |&w| w < block)
        .chain((block > 0).then_some(block))
}

/// What the policy picked after drafting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Verify nothing: a plain step.
    Plain,
    /// Verify the `r` most likely slots, eagerly.
    Slots(usize),
    /// Every sequence verifies its first γ drafts (a uniform round, replayed from a graph, or
    /// beside waiting prompts run eagerly with them; γ = the block: the whole-block round).
    Uniform(usize),
    /// A cost is unknown: verify under the confidence rule, and measure.
    Explore,
}

/// How a finished decode-only step looked, for the cost estimates.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Observed {
    /// Running sequences.
    pub seqs: usize,
    /// Sequences that drafted (0: no drafter pass).
    pub drafted: usize,
    /// Rows of the target forward.
    pub rows: usize,
    /// Whether the rows verified drafts (a round).
    pub round: bool,
    /// Whether the forward was replayed from a graph.
    pub graph: bool,
    /// Seconds of the drafter pass (0 without one).
    pub draft_secs: f64,
    /// Seconds of the whole step.
    pub step_secs: f64,
    /// Whether the step captured a CUDA graph (the target's or the drafter's): it then paid a
    /// one-off cost that says nothing about its shape, and teaches the cost curves nothing.
    pub captured: bool,
}

/// The `goodput` policy's state: cost curves, acceptance, exploration counters.
#[derive(Debug, Clone, Default)]
pub(crate) struct Goodput {
    /// Decode-only steps without drafts, by sequences.
    plain: CostCurve,
    /// The drafter pass, by drafting sequences.
    draft: CostCurve,
    /// Eager rounds, drafter pass excluded, by rows.
    verify: CostCurve,
    /// Uniform rounds replayed from a graph, drafter pass excluded, by sequences; indexed by
    /// the drafts each sequence verified.
    graph_verify: Vec<CostCurve>,
    /// Eager steps that carried prompts, drafter pass excluded, by all their rows.
    with_prompts: RowFit,
    acceptance: Acceptance,
    /// Acceptance by the head's per-slot survival.
    slots: SlotCalibration,
    /// Steps since the last drafter pass / the last plain step.
    since_round: u32,
    since_plain: u32,
    /// Seconds of the steps since the last drafter pass / the last plain step.
    secs_since_round: f64,
    secs_since_plain: f64,
    /// Seconds of the last step with a drafter pass / the last plain step (the cost of an
    /// option before it has an estimate of its own).
    last_round_secs: f64,
    last_plain_secs: f64,
}

impl Goodput {
    /// The plain decode step's estimated seconds at `seqs` sequences (for tests).
    #[cfg(test)]
    pub fn plain_estimate(&self, seqs: usize) -> Option<f64> {
        self.plain.estimate(seqs)
    }

    /// The line of the steps that carried prompts, `(a, b)` (for tests).
    #[cfg(test)]
    pub fn prompt_fit(&self) -> Option<(f64, f64)> {
        self.with_prompts.line()
    }

    /// Feeds a finished decode-only step into the cost curves.
    pub fn observe(&mut self, o: Observed) {
        let secs = if o.step_secs.is_finite() {
            o.step_secs.max(0.0)
        } else {
            0.0
        };
        // What was run and when: kept for every step.
        if o.drafted > 0 {
            self.since_round = 0;
            self.secs_since_round = 0.0;
            self.last_round_secs = secs;
        } else {
            self.since_round = self.since_round.saturating_add(1);
            self.secs_since_round += secs;
        }
        if o.round {
            self.since_plain = self.since_plain.saturating_add(1);
            self.secs_since_plain += secs;
        } else {
            self.since_plain = 0;
            self.secs_since_plain = 0.0;
            self.last_plain_secs = secs;
        }
        // What it cost: not from a step that captured a graph. Session 52: captures recorded at
        // 64-127 sequences left the whole-block round's estimate at 28 ms against the ~6 it
        // cost, and the policy ran plain steps for whole benchmark levels (exploring pulls an
        // estimate back only 10 % a round).
        if o.captured {
            return;
        }
        if o.drafted > 0 {
            self.draft.record(o.drafted, o.draft_secs);
        }
        let rest = o.step_secs - o.draft_secs;
        match (o.round, o.graph) {
            (false, _) => self.plain.record(o.seqs, rest),
            (true, true) => {
                let width = o.rows.saturating_sub(o.seqs) / o.seqs.max(1);
                if self.graph_verify.len() <= width {
                    self.graph_verify.resize(width + 1, CostCurve::default());
                }
                self.graph_verify[width].record(o.seqs, rest);
            }
            (true, false) => self.verify.record(o.rows, rest),
        }
    }

    /// Feeds a finished step that carried prompts: `rows` of every kind, `secs` without the
    /// drafter pass.
    pub fn observe_prompt_step(&mut self, rows: usize, secs: f64) {
        self.with_prompts.record(rows, secs);
    }

    /// The line of [`RowFit`] when prompts wait to join this step, it is known, and uniform
    /// rounds are possible: beside prompts the policy offers only those (every sequence
    /// verifying as many drafts, as `fixed:N` does; session 44's pricing that verified the
    /// most likely slots there made those steps 2–2.6× dearer on the host).
    fn prompt_line(&self, s: Shape) -> Option<(f64, f64)> {
        (s.prompt_rows > 0 && s.uniform > 0 && s.eligible == s.seqs)
            .then(|| self.with_prompts.line())
            .flatten()
    }

    /// Seconds of a plain step of this shape: beside waiting prompts its decode part
    /// `a + b·n`, else the decode-only step.
    fn plain_cost(&self, s: Shape) -> Option<f64> {
        match self.prompt_line(s) {
            Some((a, b)) => Some(a + b * s.seqs as f64),
            None => self.plain.estimate(s.seqs),
        }
    }

    /// Seconds of a uniform round of `gamma` drafts per sequence, drafter pass excluded:
    /// decode-only, the graph round; beside waiting prompts, a graph round that leaves them a
    /// forward of their own plus that forward's intercept, or else an eager round with them.
    fn uniform_cost(&self, s: Shape, gamma: usize) -> Option<f64> {
        match self.prompt_line(s) {
            None => self.graph_cost(s.seqs, gamma, s.block),
            Some((a, _)) if s.graphs(gamma) && s.splits && s.prompt_rows <= s.seqs * gamma => {
                Some(self.graph_cost(s.seqs, gamma, s.block)? + a)
            }
            Some((a, b)) => Some(a + b * (s.seqs * (1 + gamma)) as f64),
        }
    }

    /// The uniform widths this step offers: beside waiting prompts every width up to the
    /// widest (the forward is eager, so any width runs), else the graphed ones.
    fn uniform_widths(&self, s: Shape) -> Vec<usize> {
        if self.prompt_line(s).is_some() {
            (1..=s.uniform.min(s.block)).collect()
        } else {
            widths(s.block).filter(|&w| s.graphs(w)).collect()
        }
    }

    /// The graph-replayed uniform rounds of `gamma` drafts per sequence, by sequences.
    fn graph_curve(&self, gamma: usize) -> Option<&CostCurve> {
        self.graph_verify.get(gamma)
    }

    /// Whether the whole-block graph round has been measured at `seqs` sequences.
    fn knows_graph(&self, seqs: usize, block: usize) -> bool {
        self.graph_curve(block).is_some_and(|c| c.knows(seqs))
    }

    /// Whether a whole-block graph round run in a step of this shape would be timed alone, and
    /// so teach the graph curve what it costs: in a decode-only step, or beside prompts that it
    /// leaves a forward of their own (`splits`, at most its drafts). Beside more prompt rows it
    /// runs eagerly with them and feeds only the prompt line, so exploring it there would be
    /// repeated step after step (session 58: 44 % of `goodput`'s steps at 2–63 sequences beside
    /// prompts). Where the prompt rows are not priced (`prompt_rows` 0) it is not known whether
    /// they split, and the round explores as before.
    fn graph_round_teaches(&self, s: Shape) -> bool {
        !s.beside_prompts || s.prompt_rows == 0 || (s.splits && s.prompt_rows <= s.seqs * s.block)
    }

    /// Seconds of a graph-replayed uniform round of `gamma` drafts per sequence at `seqs`
    /// sequences, drafter pass excluded: measured, or until this width has been measured at
    /// this size, interpolated between the plain step and the whole-block round, linearly in
    /// rows (what a batch large enough to be bound by its rows costs; a launch-bound small one
    /// costs less than that, and the first measurement corrects it either way).
    fn graph_cost(&self, seqs: usize, gamma: usize, block: usize) -> Option<f64> {
        if let Some(c) = self.graph_curve(gamma).filter(|c| c.knows(seqs)) {
            return c.estimate(seqs);
        }
        let whole = self.graph_curve(block)?.estimate(seqs)?;
        if gamma >= block {
            return Some(whole);
        }
        let plain = self.plain.estimate(seqs)?;
        Some(plain + (whole - plain).max(0.0) * gamma as f64 / block as f64)
    }

    /// The cheapest round this shape could run, drafter pass included (one draft per
    /// sequence eagerly, or the whole-block graph round), from the estimates; the last
    /// round's time before there are any.
    fn round_cost(&self, s: Shape) -> f64 {
        let verify = if s.graphs(s.block) {
            self.graph_cost(s.seqs, s.block, s.block)
        } else {
            self.verify.estimate(s.seqs + s.eligible)
        };
        match (self.draft.estimate(s.eligible), verify) {
            (Some(d), Some(v)) => d + v,
            _ => self.last_round_secs,
        }
    }

    /// Whether a round is due to refresh the estimates of an avoided speculation.
    fn round_due(&self, s: Shape) -> bool {
        self.since_round >= EXPLORE_EVERY
            && self.secs_since_round >= EXPLORE_RATIO * self.round_cost(s)
    }

    /// Whether a plain step is due to refresh the estimate of avoided plain decoding.
    fn plain_due(&self, s: Shape) -> bool {
        let cost = self.plain.estimate(s.seqs).unwrap_or(self.last_plain_secs);
        self.since_plain >= EXPLORE_EVERY && self.secs_since_plain >= EXPLORE_RATIO * cost
    }

    /// Feeds one sequence's round into the acceptance estimates: `survival` holds its γ
    /// drafts' cumulative survivals as the head predicted them, `accepted` how many were (or,
    /// for drafts not verified, would have been) accepted.
    pub fn observe_round(&mut self, survival: &[f32], accepted: usize) {
        let predicted = survival.iter().map(|&p| f64::from(p)).sum();
        self.acceptance.record(survival.len(), accepted, predicted);
        for (k, &p) in survival.iter().enumerate() {
            self.slots.record(p, k < accepted);
        }
    }

    /// What a slot of cumulative survival `p` is expected to add: its bin's observed rate,
    /// or the head's value times the global calibration while the bin has too few outcomes.
    fn slot_value(&self, p: f32, cal: f64) -> f64 {
        self.slots
            .rate(p)
            .unwrap_or_else(|| (f64::from(p) * cal).min(1.0))
    }

    /// The calibration factor for the head's survivals.
    pub fn calibration(&self) -> f64 {
        self.acceptance.calibration()
    }

    /// Whether to run the drafter this step.
    pub fn should_draft(&self, s: Shape) -> bool {
        if s.eligible == 0 || s.block == 0 {
            return false;
        }
        // Measure what is unknown, and now and then what has been avoided.
        if !self.plain.knows(s.seqs) || self.plain_due(s) {
            return false;
        }
        if self.round_due(s) {
            return true;
        }
        let graph = s.graphs(s.block);
        if !self.acceptance.known()
            || !self.draft.knows(s.eligible)
            || (graph && !self.knows_graph(s.seqs, s.block) && self.graph_round_teaches(s))
            || (!graph && !self.verify.measured() && !s.beside_prompts)
        {
            return true;
        }
        let Some(plain) = self.plain_cost(s) else {
            return true;
        };
        let Some(draft) = self.draft.estimate(s.eligible) else {
            return true;
        };
        let n = s.seqs as f64;
        let m = s.eligible as f64;
        let plain_rate = n / plain;
        let mut best = 0.0f64;
        for gamma in 1..=s.block {
            let slots = s.eligible * gamma;
            if slots > s.budget || self.prompt_line(s).is_some() {
                break;
            }
            if let Some(v) = self.verify.estimate(s.seqs + slots) {
                let tokens = n + m * self.acceptance.expected(gamma);
                best = best.max(tokens / (draft + v));
            }
        }
        if let Some((_, rate)) = self.best_uniform(s, draft) {
            best = best.max(rate);
        }
        best > plain_rate
    }

    /// The uniform width with the most expected tokens a second at the acceptance estimates,
    /// and that rate, given the drafter pass's `draft` seconds (`None` with no width priced).
    fn best_uniform(&self, s: Shape, draft: f64) -> Option<(usize, f64)> {
        let n = s.seqs as f64;
        let m = s.eligible as f64;
        let mut best: Option<(usize, f64)> = None;
        for gamma in self.uniform_widths(s) {
            let Some(v) = self.uniform_cost(s, gamma) else {
                continue;
            };
            let rate = (n + m * self.acceptance.expected(gamma)) / (draft + v);
            if best.is_none_or(|(_, r)| rate > r) {
                best = Some((gamma, rate));
            }
        }
        best
    }

    /// Beside waiting prompts, the uniform round to verify chosen *before* drafting, from the
    /// acceptance estimates rather than this step's confidences, so that the drafter's pass can
    /// be queued on the device right ahead of the verify forward instead of the host waiting for
    /// its drafts and confidences in between (session 58: 2.1 ms of a 16.5 ms prompt step at
    /// c = 256 went to that wait, against `fixed:4`'s queued 0.33). `None` where the step is not
    /// beside priced prompts, where something is still unmeasured or due to be explored, or where
    /// no round beats a plain step: the caller then drafts on the host and [`Self::choose`]
    /// decides as before. Call only after [`Self::should_draft`] said to draft.
    pub fn width_before_drafting(&self, s: Shape) -> Option<usize> {
        self.prompt_line(s)?;
        if self.round_due(s) || !self.acceptance.known() || !self.draft.knows(s.eligible) {
            return None;
        }
        let plain = self.plain_cost(s)?;
        let draft = self.draft.estimate(s.eligible)?;
        let (gamma, rate) = self
            .best_uniform(s, draft)
            .filter(|&(_, r)| r > s.seqs as f64 / plain)?;
        tracing::debug!(
            seqs = s.seqs,
            eligible = s.eligible,
            budget = s.budget,
            prompt_rows = s.prompt_rows,
            plain_ms = plain * 1e3,
            choice = ?Choice::Uniform(gamma),
            tokens_per_ms = rate / 1e3,
            queued = true,
            "goodput choice"
        );
        Some(gamma)
    }

    /// After drafting: how many of `survival` (every candidate slot's cumulative survival as
    /// the head predicted it, sorted in decreasing order) to verify, or which uniform round
    /// (`by_seq`: each drafting sequence's cumulative survivals in block order, the drafts it
    /// can use).
    pub fn choose(&self, s: Shape, survival: &[f32], by_seq: &[Vec<f32>]) -> Choice {
        let graph = s.graphs(s.block) && by_seq.len() == s.seqs;
        // Which cost is unknown, if any (the trace names it: session 57's lease showed a
        // stretch of steps at c = 256 with no "goodput choice" line at all).
        let plain = self.plain_cost(s);
        let unknown = match plain {
            None => Some("plain step"),
            Some(_) if self.round_due(s) => Some("round due"),
            Some(_)
                if graph && !self.knows_graph(s.seqs, s.block) && self.graph_round_teaches(s) =>
            {
                Some("graph round")
            }
            // The eager curve is learnt from decode-only eager rounds: a round beside prompts
            // would not teach it, so there the options it prices are left out instead
            // (session 57, c = 256: nearly every step carried prompts, so every round
            // explored, under the confidence rule with the whole verify budget).
            Some(_) if !graph && !self.verify.measured() && !s.beside_prompts => {
                Some("eager round")
            }
            Some(_) => None,
        };
        let (Some(plain), None) = (plain, unknown) else {
            tracing::debug!(
                seqs = s.seqs,
                eligible = s.eligible,
                prompt_rows = s.prompt_rows,
                beside_prompts = s.beside_prompts,
                unknown = unknown.unwrap_or_default(),
                "goodput explores"
            );
            return Choice::Explore;
        };
        let cal = self.calibration();
        let n = s.seqs as f64;
        let mut best = (Choice::Plain, n / plain);
        let mut tokens = n;
        let slots = if self.prompt_line(s).is_some() {
            0
        } else {
            s.budget
        };
        for (r, &p) in survival.iter().take(slots).enumerate() {
            tokens += self.slot_value(p, cal);
            // Widths never tried are estimated pessimistically (flat below what was seen,
            // proportional above), so the policy reaches them only when they look worth it.
            if let Some(t) = self.verify.estimate(s.seqs + r + 1) {
                if tokens / t > best.1 {
                    best = (Choice::Slots(r + 1), tokens / t);
                }
            }
        }
        let uniform = self
            .uniform_widths(s)
            .into_iter()
            .filter(|_| by_seq.len() == s.seqs);
        // (γ, expected tokens, estimated ms) of each uniform round, for the trace below.
        let mut rounds: Vec<(usize, f64, f64)> = Vec::new();
        for gamma in uniform {
            if let Some(t) = self.uniform_cost(s, gamma) {
                let value: f64 = by_seq
                    .iter()
                    .flat_map(|v| v.iter().take(gamma))
                    .map(|&p| self.slot_value(p, cal))
                    .sum();
                rounds.push((gamma, n + value, t * 1e3));
                if (n + value) / t > best.1 {
                    best = (Choice::Uniform(gamma), (n + value) / t);
                }
            }
        }
        // Why a step verified what it did, at the policy's own estimates (session 49: at 128
        // sequences it kept verifying 6–8 drafts where fixed lengths of 3–4 served more).
        // `FERRY_LOG=ferry_model::engine::goodput=debug` prints one line a step.
        tracing::debug!(
            seqs = s.seqs,
            eligible = s.eligible,
            budget = s.budget,
            prompt_rows = s.prompt_rows,
            prompt_line = ?self.prompt_line(s).map(|(a, b)| (a * 1e3, b * 1e6)),
            plain_ms = plain * 1e3,
            calibration = cal,
            choice = ?best.0,
            tokens_per_ms = best.1 / 1e3,
            ?rounds,
            "goodput choice"
        );
        best.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device whose decode step costs `base` up to `flat` rows and grows linearly after,
    /// with a drafter pass of `draft` seconds, fed to the policy as measured steps.
    fn trained(base: f64, flat: usize, per_row: f64, draft: f64, accept: f64) -> Goodput {
        let cost = |rows: usize| base + per_row * rows.saturating_sub(flat) as f64;
        let mut g = Goodput::default();
        let sizes = [1usize, 2, 4, 8, 16, 32, 64, 128, 256];
        for n in sizes {
            for gamma in [1, 2, 4, 8] {
                g.observe(Observed {
                    seqs: n,
                    drafted: n,
                    rows: n * (1 + gamma),
                    round: true,
                    graph: false,
                    draft_secs: draft,
                    step_secs: draft + cost(n * (1 + gamma)),
                    captured: false,
                });
            }
        }
        // Plain steps last: the policy then has no reason to re-measure them.
        for n in sizes {
            for _ in 0..3 {
                g.observe(plain_step(n, cost(n)));
            }
        }
        // Geometric acceptance at `accept` per position, as the head predicts (one pseudo-random
        // stream over all rounds).
        let mut x = 0.37f64;
        for _ in 0..400 {
            let gamma = 8;
            let mut accepted = 0;
            while accepted < gamma {
                x = (x * 7919.0 + 0.1234).fract();
                if x >= accept {
                    break;
                }
                accepted += 1;
            }
            let survival: Vec<f32> = (1..=gamma).map(|k| accept.powi(k as i32) as f32).collect();
            g.observe_round(&survival, accepted);
        }
        g
    }

    /// A decode-only step of `seqs` sequences without drafts that took `secs`.
    fn plain_step(seqs: usize, secs: f64) -> Observed {
        Observed {
            seqs,
            drafted: 0,
            rows: seqs,
            round: false,
            graph: false,
            draft_secs: 0.0,
            step_secs: secs,
            captured: false,
        }
    }

    /// A uniform round of `gamma` drafts for each of `seqs` sequences, replayed from a graph
    /// in `secs`, after a 0.2 ms drafter pass.
    fn graph_round(seqs: usize, gamma: usize, secs: f64) -> Observed {
        Observed {
            seqs,
            drafted: seqs,
            rows: seqs * (gamma + 1),
            round: true,
            graph: true,
            draft_secs: 0.2e-3,
            step_secs: 0.2e-3 + secs,
            captured: false,
        }
    }

    #[test]
    fn steps_that_captured_a_graph_teach_the_curves_nothing() {
        // Session 52's lease: captures recorded at 64-127 sequences left the whole-block
        // round's estimate at 28 ms against the ~6 it cost, and `goodput` ran plain steps
        // through whole benchmark levels.
        let mut g = Goodput::default();
        for secs in [0.030, 0.040, 0.035] {
            g.observe(Observed {
                captured: true,
                ..graph_round(100, 8, secs)
            });
            g.observe(Observed {
                captured: true,
                ..plain_step(100, secs)
            });
        }
        let curve = |g: &Goodput| g.graph_curve(8).and_then(|c| c.estimate(100));
        assert_eq!(curve(&g), None, "captures alone measure nothing");
        assert_eq!(g.plain_estimate(100), None);
        assert!(!g.draft.measured());
        for _ in 0..2 {
            g.observe(graph_round(100, 8, 0.006));
            g.observe(plain_step(100, 0.002));
        }
        // A capture after the shape is known moves nothing either.
        g.observe(Observed {
            captured: true,
            ..graph_round(100, 8, 0.040)
        });
        let round = curve(&g).expect("measured twice");
        assert!((round - 0.006).abs() < 1e-12, "{round}");
        let plain = g.plain_estimate(100).expect("measured twice");
        assert!((plain - 0.002).abs() < 1e-12, "{plain}");
        let draft = g.draft.estimate(100).expect("measured twice");
        assert!((draft - 0.2e-3).abs() < 1e-12, "{draft}");
    }

    fn survivals(seqs: usize, block: usize, c: f32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..seqs)
            .flat_map(|_| (1..=block).map(move |k| c.powi(k as i32)))
            .collect();
        v.sort_by(|a, b| b.total_cmp(a));
        v
    }

    fn shape(seqs: usize) -> Shape {
        Shape {
            seqs,
            eligible: seqs,
            block: 8,
            budget: 64,
            graph_widths: 0,
            uniform: 0,
            prompt_rows: 0,
            beside_prompts: false,
            splits: false,
        }
    }

    #[test]
    fn a_cost_curve_interpolates_and_is_pessimistic_beyond_what_it_saw() {
        let mut c = CostCurve::default();
        assert_eq!(c.estimate(4), None);
        assert!(!c.knows(4));
        c.record(4, 1.0);
        c.record(4, 1.0);
        c.record(16, 3.0);
        c.record(16, 3.0);
        assert_eq!(c.estimate(1), Some(1.0));
        assert!((c.estimate(10).unwrap() - 2.0).abs() < 1e-9);
        assert!((c.estimate(32).unwrap() - 6.0).abs() < 1e-9);
        assert!(c.knows(8) && c.knows(16) && !c.knows(64));
    }

    #[test]
    fn a_first_expensive_observation_gives_way_to_a_cheaper_second() {
        let mut c = CostCurve::default();
        c.record(8, 0.5); // a graph capture
        c.record(8, 0.001);
        assert_eq!(c.estimate(8), Some(0.001));
        for _ in 0..10 {
            c.record(8, 10.0); // outliers move it by at most 3x per step, weighted
        }
        assert!(c.estimate(8).unwrap() < 0.01);
    }

    #[test]
    fn acceptance_counts_reached_positions_only() {
        let mut a = Acceptance::default();
        assert!(!a.known());
        for _ in 0..100 {
            a.record(4, 2, 2.0); // drafts 0, 1 accepted, 2 rejected, 3 never reached
        }
        assert!(a.known());
        assert!((a.expected(2) - 2.0).abs() < 1e-9);
        assert!(a.expected(4) < 2.0 + 1e-9);
        assert!((a.calibration() - 1.0).abs() < 1e-9);
        let mut b = Acceptance::default();
        for _ in 0..100 {
            b.record(4, 1, 4.0); // the head promised 4, one came
        }
        assert!((b.calibration() - 0.25).abs() < 1e-6);
    }

    #[test]
    fn a_launch_bound_device_speculates_at_every_load_it_pays_for() {
        // Flat cost up to 256 rows (a small model on a GPU): verifying costs nothing extra.
        let g = trained(1e-3, 256, 1e-5, 0.3e-3, 0.8);
        assert!(g.should_draft(shape(1)));
        assert!(g.should_draft(shape(16)));
        let c = g.choose(shape(16), &survivals(16, 8, 0.8), &[]);
        assert_eq!(c, Choice::Slots(64), "the whole budget pays: {c:?}");
    }

    #[test]
    fn a_saturated_device_stops_speculating_when_rows_cost_what_tokens_are_worth() {
        // Cost grows with every row past 8 (a large batch on a big model): a verified draft
        // costs a full token's time but is only accepted 30 % of the time.
        let g = trained(1e-3, 8, 1e-3 / 8.0, 2e-3, 0.3);
        assert!(
            !g.should_draft(shape(64)),
            "plain decoding wins at batch 64"
        );
        let c = g.choose(shape(64), &survivals(64, 8, 0.3), &[]);
        assert_eq!(c, Choice::Plain);
    }

    #[test]
    fn low_acceptance_switches_drafting_off_even_at_batch_one() {
        let g = trained(1e-3, 256, 0.0, 0.9e-3, 0.02);
        assert!(!g.should_draft(shape(1)));
    }

    #[test]
    fn the_policy_admits_the_most_likely_slots_when_only_some_pay() {
        // A step of n rows costs n·c past 32 rows: at batch 16 the first 16 slots are free,
        // later ones cost 1/16 of a step each; slots survive with 0.9, 0.81, ... per position.
        let g = trained(16e-4, 32, 1e-4, 0.2e-3, 0.9);
        let c = g.choose(shape(16), &survivals(16, 8, 0.9), &[]);
        match c {
            Choice::Slots(r) => assert!((16..64).contains(&r), "{r} slots"),
            other => panic!("expected some slots, got {other:?}"),
        }
    }

    #[test]
    fn a_slot_bin_speaks_only_after_enough_outcomes() {
        let mut c = SlotCalibration::default();
        for _ in 0..8 {
            c.record(0.15, true);
        }
        assert_eq!(c.rate(0.15), None, "8 outcomes, decayed, weigh under 8");
        c.record(0.12, false);
        let r = c.rate(0.19).expect("9 outcomes in the bin [0.1, 0.2)");
        assert!((r - 8.0 / 9.0).abs() < 0.02, "{r}");
        assert_eq!(c.rate(0.25), None, "another bin");
    }

    #[test]
    fn a_head_wrong_only_at_low_confidence_is_corrected_by_its_bins() {
        // Each row past the first costs half a step: a slot pays if it is accepted more often
        // than half the time. The head says 0.2, 0.04, ... for drafts that are all accepted.
        let mut g = trained(1e-3, 1, 0.5e-3, 0.2e-3, 0.8);
        let low = survivals(1, 8, 0.2);
        assert_eq!(
            g.choose(shape(1), &low, &[]),
            Choice::Plain,
            "taken at its word, nothing pays"
        );
        for _ in 0..100 {
            g.observe_round(&low, 8);
        }
        // One factor for every slot could not have found it: clamped, it still leaves the
        // first slot under half.
        assert!(0.2 * g.calibration() < 0.5, "{}", g.calibration());
        assert_eq!(g.choose(shape(1), &low, &[]), Choice::Slots(8));
    }

    #[test]
    fn a_large_batch_verifies_a_narrower_uniform_round_than_a_small_one() {
        // Rows cost little each past 64 (2 µs), so a whole block pays at batch 1 and still
        // pays at 128, but there its last drafts (accepted 0.8^k) are not worth their rows. A
        // round replayed from a graph costs 0.7 of an eager one.
        let cost = |rows: usize| 1e-3 + 2e-6 * rows.saturating_sub(64) as f64;
        let graphed = |rows: usize| 0.7 * cost(rows);
        let mut g = trained(1e-3, 64, 2e-6, 0.2e-3, 0.8);
        for n in [1usize, 128] {
            for _ in 0..2 {
                g.observe(graph_round(n, 8, graphed(n * 9)));
            }
        }
        let all: u32 = widths(8).map(|w| 1 << w).sum();
        assert_eq!(all, 0b1_0001_0110, "widths 1, 2, 4 and the block");
        let by_seq = |n: usize| vec![(1..=8).map(|k| 0.8f32.powi(k)).collect::<Vec<_>>(); n];
        let choose = |g: &Goodput, n: usize| {
            let s = Shape {
                graph_widths: all,
                budget: 8 * n,
                ..shape(n)
            };
            g.choose(s, &survivals(n, 8, 0.8), &by_seq(n))
        };
        assert_eq!(choose(&g, 1), Choice::Uniform(8));
        // Width 4 was never measured: its cost is interpolated between the plain step and the
        // whole block, 4/8 of the way.
        let t4 = g.graph_cost(128, 4, 8).unwrap();
        let want = cost(128) + (graphed(128 * 9) - cost(128)) / 2.0;
        assert!((t4 - want).abs() < 1e-9, "{t4} vs {want}");
        assert_eq!(choose(&g, 128), Choice::Uniform(4));
        // Once measured as dear as the whole block, it gives way to it.
        for _ in 0..2 {
            g.observe(graph_round(128, 4, graphed(128 * 9)));
        }
        assert_eq!(choose(&g, 128), Choice::Uniform(8));
    }

    #[test]
    fn a_row_fit_finds_the_line_once_the_rows_spread() {
        let line = |rows: usize| 2e-3 + 5e-6 * rows as f64;
        let mut f = RowFit::default();
        f.record(1536, 3.0); // a first step that compiled kernels
        for _ in 0..20 {
            f.record(1536, line(1536));
        }
        assert_eq!(f.line(), None, "one size tells no slope");
        for i in 0..40 {
            let rows = 1100 + 37 * (i % 26);
            f.record(rows, line(rows));
        }
        let (a, b) = f.line().expect("a known line");
        assert!(
            (a - 2e-3).abs() < 1e-5 && (b - 5e-6).abs() < 1e-8,
            "{a} {b}"
        );
    }

    /// A device on which a decode-only step costs 1 ms whatever its rows (launch-bound; graph
    /// rounds 0.7 ms at every width) and a step that carries prompts `2 ms + 5.6 µs a row`,
    /// drafts accepted 0.8^k.
    fn with_prompt_steps() -> Goodput {
        let mut g = trained(1e-3, 1 << 20, 0.0, 0.2e-3, 0.8);
        graph_rounds_and_prompt_steps(&mut g);
        g
    }

    /// Graph rounds of every width at 128 sequences (0.7 ms) and forty steps with prompts
    /// (`2 ms + 5.6 µs a row`).
    fn graph_rounds_and_prompt_steps(g: &mut Goodput) {
        for gamma in [1, 2, 4, 8] {
            for _ in 0..2 {
                g.observe(graph_round(128, gamma, 0.7e-3));
            }
        }
        for i in 0..40 {
            let rows = 1100 + 37 * (i % 26);
            g.observe_prompt_step(rows, 2e-3 + 5.6e-6 * rows as f64);
        }
    }

    fn choose_at_128(g: &Goodput, prompt_rows: usize, splits: bool) -> Choice {
        let by_seq = vec![(1..=8).map(|k| 0.8f32.powi(k)).collect::<Vec<_>>(); 128];
        let s = Shape {
            graph_widths: widths(8).map(|w| 1 << w).sum(),
            uniform: 8,
            budget: 8 * 128,
            prompt_rows,
            splits,
            ..shape(128)
        };
        g.choose(s, &survivals(128, 8, 0.8), &by_seq)
    }

    #[test]
    fn beside_waiting_prompts_a_draft_costs_its_row() {
        let g = with_prompt_steps();
        // Decode-only, rows are free: the whole block.
        assert_eq!(choose_at_128(&g, 0, false), Choice::Uniform(8));
        // Beside 1,024 prompt rows the step runs eagerly and each row costs 5.6 µs: a draft
        // pays while it is accepted more often than 5.6 µs × the step's ~77 tokens a ms (0.43):
        // the first three of every sequence (0.8, 0.64, 0.51), the fourth (0.41) about even
        // (77.6 against 77.1 tokens a ms at the head's values; the learnt bins decide), and
        // never the whole block (65.6). Any width runs eagerly, so 3 is offered though no
        // graph holds it.
        let c = choose_at_128(&g, 1024, false);
        assert!(matches!(c, Choice::Uniform(3 | 4)), "{c:?}");
        let beside = Shape {
            uniform: 8,
            prompt_rows: 1024,
            ..shape(128)
        };
        assert!(
            g.should_draft(beside),
            "speculation still pays beside prompts"
        );
        // No line for a step whose sequences cannot all verify alike: priced as before.
        let uneven = Shape {
            eligible: 127,
            ..beside
        };
        assert_eq!(g.prompt_line(uneven), None);
    }

    #[test]
    fn beside_priced_prompts_an_unmeasured_graph_round_explores_only_where_it_splits() {
        // Session 58's lease, drafts beside the budget: at 2-63 sequences with ~1,800 prompt
        // rows waiting, the whole-block graph round at that size was unmeasured, so nearly half
        // the steps explored it; with the prompts joining (more rows than its drafts) the round
        // ran eagerly and its timing fed only the prompt line.
        let mut g = with_prompt_steps();
        for _ in 0..3 {
            g.observe(plain_step(32, 0.9e-3));
        }
        let by_seq = vec![(1..=8).map(|k| 0.8f32.powi(k)).collect::<Vec<_>>(); 32];
        let beside = Shape {
            graph_widths: widths(8).map(|w| 1 << w).sum(),
            uniform: 8,
            budget: 8 * 32,
            prompt_rows: 1800,
            beside_prompts: true,
            splits: true,
            ..shape(32)
        };
        assert!(!g.knows_graph(32, 8));
        let choose = |s: Shape| g.choose(s, &survivals(32, 8, 0.8), &by_seq);
        // 1,800 prompt rows against 256 drafts: no split, so no exploring; an eager uniform
        // round at the prompt line's price, or a plain step.
        let c = choose(beside);
        assert!(matches!(c, Choice::Uniform(_) | Choice::Plain), "{c:?}");
        // Prompt rows the whole block's drafts cover: the round keeps its graph, which its
        // timing then teaches.
        let splits = Shape {
            prompt_rows: 200,
            ..beside
        };
        assert_eq!(choose(splits), Choice::Explore);
        assert!(g.should_draft(splits));
        // Decode-only, as before.
        let alone = Shape {
            prompt_rows: 0,
            beside_prompts: false,
            ..beside
        };
        assert_eq!(choose(alone), Choice::Explore);
    }

    #[test]
    fn beside_waiting_prompts_the_width_is_picked_before_drafting() {
        let g = with_prompt_steps();
        let beside = Shape {
            graph_widths: widths(8).map(|w| 1 << w).sum(),
            uniform: 8,
            budget: 8 * 128,
            prompt_rows: 1024,
            ..shape(128)
        };
        // The same prices as `choose` beside prompts, from the acceptance estimates (0.8 a
        // slot): a narrow round, never the whole block (each row costs 5.6 µs there).
        let w = g.width_before_drafting(beside);
        assert!(matches!(w, Some(2..=4)), "{w:?}");
        // Decode-only steps keep drafting on the host: `choose` reads the confidences there.
        assert_eq!(
            g.width_before_drafting(Shape {
                prompt_rows: 0,
                ..beside
            }),
            None
        );
        // Nor before the acceptance is known: the round explores through `choose`.
        let mut fresh = Goodput::default();
        graph_rounds_and_prompt_steps(&mut fresh);
        for _ in 0..8 {
            fresh.observe(plain_step(128, 1e-3));
        }
        assert_eq!(fresh.width_before_drafting(beside), None);
        // Where drafts cost more than they bring (a slot accepted 1 time in 20), no round:
        // the caller drafts on the host and `choose` decides (a plain step).
        let mut poor = trained(1e-3, 1 << 20, 0.0, 0.2e-3, 0.05);
        graph_rounds_and_prompt_steps(&mut poor);
        assert_eq!(poor.width_before_drafting(beside), None);
    }

    #[test]
    fn beside_prompts_an_unmeasured_eager_round_is_not_explored() {
        // Session 57's lease at c = 256: whole-block rounds past the graphs' rows, and prompts
        // beside nearly every step, so no decode-only eager round ever measured the eager curve
        // and every round explored (the confidence rule, up to the whole verify budget).
        let mut g = Goodput::default();
        for _ in 0..3 {
            g.observe(plain_step(256, 3.5e-3));
        }
        graph_rounds_and_prompt_steps(&mut g);
        for _ in 0..50 {
            let survival: Vec<f32> = (1..=8).map(|k| 0.8f32.powi(k)).collect();
            g.observe_round(&survival, 3);
        }
        let by_seq = vec![(1..=8).map(|k| 0.8f32.powi(k)).collect::<Vec<_>>(); 256];
        let alone = Shape {
            graph_widths: (1 << 1) | (1 << 2),
            uniform: 8,
            budget: 1024,
            ..shape(256)
        };
        let choose = |s: Shape| g.choose(s, &survivals(256, 8, 0.8), &by_seq);
        // Decode-only, the eager round explores: it is measured.
        assert_eq!(choose(alone), Choice::Explore);
        assert!(g.should_draft(alone));
        // Beside prompts it would not be. Priced (`FERRY_GOODPUT_PROMPTS=1`): a uniform round
        // at the prompt line's price. Unpriced: the options whose costs are known, here a
        // width a graph holds at 256 sequences (1 or 2), from the graph rounds' curves.
        let priced = Shape {
            prompt_rows: 1024,
            beside_prompts: true,
            ..alone
        };
        let c = choose(priced);
        assert!(matches!(c, Choice::Uniform(1..=8)), "{c:?}");
        let unpriced = Shape {
            beside_prompts: true,
            ..alone
        };
        assert!(matches!(choose(unpriced), Choice::Uniform(1 | 2)));
        assert!(g.should_draft(unpriced));
    }

    #[test]
    fn a_graph_round_that_leaves_prompts_their_own_forward_pays_one_more_intercept() {
        let g = with_prompt_steps();
        // 512 prompt rows run apart from a round of at least 512 drafts: 0.7 ms + 2 ms for
        // the whole block's 554 tokens beats the eager rounds' ~77 tokens a ms.
        assert_eq!(choose_at_128(&g, 512, true), Choice::Uniform(8));
    }

    #[test]
    fn unknown_costs_are_measured_before_they_are_trusted() {
        let g = Goodput::default();
        // No plain estimate yet: run a plain step first.
        assert!(!g.should_draft(shape(4)));
        let mut g = Goodput::default();
        g.observe(plain_step(4, 1e-3));
        g.observe(plain_step(4, 1e-3));
        // Plain known, rounds not: draft, and verify under the confidence rule.
        assert!(g.should_draft(shape(4)));
        assert_eq!(
            g.choose(shape(4), &survivals(4, 8, 0.5), &[]),
            Choice::Explore
        );
    }

    #[test]
    fn an_avoided_option_is_tried_again_now_and_then() {
        let mut g = trained(1e-3, 8, 1e-3 / 8.0, 2e-3, 0.3);
        assert!(!g.should_draft(shape(64)));
        let step = 1e-3 + 56.0 * 1e-3 / 8.0;
        let mut steps = 0u32;
        while !g.should_draft(shape(64)) {
            g.observe(plain_step(64, step));
            steps += 1;
            assert!(steps < 10_000, "the avoided round is never tried again");
        }
        // A round here (drafter pass + 128 verify rows, at most 18 ms) costs about two plain
        // steps (8 ms), so the time rule waits past EXPLORE_EVERY steps, but not longer than
        // EXPLORE_RATIO rounds' worth of time.
        assert!(steps > EXPLORE_EVERY, "{steps}");
        assert!(
            f64::from(steps) * step <= EXPLORE_RATIO * 18e-3 * 1.1,
            "{steps}"
        );
        assert_eq!(
            g.choose(shape(64), &survivals(64, 8, 0.3), &[]),
            Choice::Explore
        );
    }

    #[test]
    fn exploring_an_expensive_round_costs_a_bounded_share_of_the_time() {
        // A launch-bound small model: a plain step 0.2 ms, a round (drafter pass + eager
        // verify forward) 2.6 ms, and drafts that are not accepted. Trying a round every 64
        // steps would spend 2.6 / (64 * 0.2 + 2.6) = 17 % of the time exploring.
        let (plain, draft, verify) = (0.2e-3, 1.0e-3, 1.6e-3);
        let mut g = Goodput::default();
        for _ in 0..3 {
            g.observe(plain_step(1, plain));
        }
        for _ in 0..3 {
            g.observe(Observed {
                seqs: 1,
                drafted: 1,
                rows: 2,
                round: true,
                graph: false,
                draft_secs: draft,
                step_secs: draft + verify,
                captured: false,
            });
            g.observe_round(&[0.5], 0);
        }
        let mut steps = 0u32;
        let mut secs = 0.0;
        while !g.should_draft(shape(1)) {
            g.observe(plain_step(1, plain));
            steps += 1;
            secs += plain;
            assert!(steps < 100_000, "the avoided round is never tried again");
        }
        assert!(steps > EXPLORE_EVERY, "{steps} plain steps");
        let share = (draft + verify) / (secs + draft + verify);
        assert!(
            share <= 1.0 / EXPLORE_RATIO,
            "exploring takes {share:.3} of the time"
        );
        assert!(
            share > 0.5 / EXPLORE_RATIO,
            "exploring waited too long: {share:.4}"
        );
    }
}
