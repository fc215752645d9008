/*
 * step_rule.h — the tail of an optimizer step, as one function that runs where the gradients are.
 *
 * After the last micro-batch's backward, backend->grad_stats writes the fused pass's result (struct
 * grad_check and per-tensor non-finite counts) into backend memory, and backend->step_finish runs
 * step_rule_finish on it, also in backend memory: it decides skip or step (docs/precision.md), the
 * unscale-and-clip factor and the learning rate, writes the scalars the optimizer updates read (struct
 * step_scalars), updates the loss scaler (scaler_update) and writes the step's log row. The CPU backend
 * calls it directly; the CUDA backend runs it in a one-thread kernel. Nothing in a step needs the
 * host to know its outcome, so a GPU step queues without a host synchronisation, and the trainer reads
 * the state and the rows of a whole log window at once (lib/engine/train.c).
 *
 * Everything here is plain data (no pointers) and AMP_HD inline code: one definition of each rule for
 * the host and every device. The arithmetic is the host's former order to the bit (doubles where it
 * used doubles, fp32 roundings where it rounded), so the CPU backend's results did not change.
 */
#ifndef AMP_STEP_RULE_H
#define AMP_STEP_RULE_H

#include <math.h>
#include <stdint.h>

#include "scaler.h" /* struct scaler, scaler_update, AMP_HD */

/* The learning-rate schedule (lib/engine/optim.h gives the formulas), as plain data. */
enum { SCHEDULE_CONSTANT, SCHEDULE_STEP, SCHEDULE_COSINE, SCHEDULE_LINEAR, SCHEDULE_WSD, SCHEDULE_INVERSE_SQRT };
struct schedule_params {
    int32_t kind;
    double lr, gamma, min_lr;
    int64_t warmup_steps, step_size, total_steps;
    int64_t decay_steps;      /* the step the decay ends at (optim.schedule.decay_steps); 0: total_steps */
    double decay_fraction;    /* wsd: the share of decay_steps - warmup_steps spent decaying */
};

/* The step the decay ends at. */
AMP_HD static inline int64_t schedule_end(const struct schedule_params *s)
{
    return s->decay_steps > 0 ? s->decay_steps : s->total_steps;
}

/* Where step t is in a decay from step `from` to the end: 0 at its start, 1 at its end and after. */
AMP_HD static inline double schedule_frac(const struct schedule_params *s, int64_t t, int64_t from)
{
    double span = (double)(schedule_end(s) - from);
    return span > 0 ? fmin(1.0, fmax(0.0, (double)(t - from) / span)) : 1.0;
}

/* Learning rate of the optimizer step that follows `t` steps taken. */
AMP_HD static inline double schedule_lr(const struct schedule_params *s, int64_t t)
{
    double lr = s->lr;
    int64_t w = s->warmup_steps;
    if (t < w)
        return lr * (double)(t + 1) / (double)w;
    if (s->kind == SCHEDULE_STEP)
        return lr * pow(s->gamma, (double)((t - w) / s->step_size));
    if (s->kind == SCHEDULE_COSINE)
        return s->min_lr + (lr - s->min_lr) * 0.5 * (1.0 + cos(3.14159265358979323846 * schedule_frac(s, t, w)));
    if (s->kind == SCHEDULE_LINEAR)
        return s->min_lr + (lr - s->min_lr) * (1.0 - schedule_frac(s, t, w));
    if (s->kind == SCHEDULE_WSD) { /* warmup, stable at lr, then linear to min_lr over the last decay_fraction */
        int64_t decay_len = (int64_t)(s->decay_fraction * (double)(schedule_end(s) - w) + 0.5);
        int64_t from = schedule_end(s) - decay_len;
        return t < from ? lr : s->min_lr + (lr - s->min_lr) * (1.0 - schedule_frac(s, t, from));
    }
    if (s->kind == SCHEDULE_INVERSE_SQRT) /* fairseq's: lr at the warmup's last step, then lr sqrt(w / step) */
        return lr * sqrt((double)(w > 0 ? w : 1) / (double)(t + 1));
    return lr;
}

/* What stays fixed through a run: passed by value to step_finish. */
struct step_params {
    int64_t micro_batches;    /* summed into one step over all ranks: accum_steps x world (data parallel) */
    double max_norm;          /* clip.max_norm; 0: no clipping */
    int32_t inf_norm;         /* clip.norm_type is inf: the norm is max |g| */
    double beta1, beta2;      /* AdamW's, as the config gives them: bias corrections 1 - beta^t in double, as PyTorch */
    float weight_decay;       /* as the fp32 value the update uses (AdamW's and SGD's) */
    int32_t sgd;              /* the optimizer is SGD (else AdamW): which update step_rule_bounded bounds */
    float eps, momentum;      /* AdamW's eps, SGD's momentum, as the updates use them */
    int32_t nesterov;
    struct schedule_params schedule;
};

/* The fused gradient pass's totals (backend->grad_stats), in backend memory. */
struct grad_check {
    double sumsq;             /* sum of squares of the finite elements (still scaled) */
    double absmax;            /* max |g| over the finite elements */
    int64_t found_nonfinite;  /* 1 when any element of any tensor is Inf or NaN */
    int64_t update_nonfinite; /* 0, or 1 + the index of the first parameter whose proposed update would store a
                               * non-finite weight or moment: set by the trial updates (optim_update_args.trial)
                               * after step_propose zeroed it */
};

/* This step's optimizer scalars, read by adamw_update / sgd_update from backend memory. */
struct step_scalars {
    int32_t skip;             /* non-finite gradients: the updates leave every tensor as it is */
    int32_t check;            /* a trial update runs only where this is 1 (step_rule_propose: its bound could not
                               * rule out a non-finite weight or moment); the update itself ignores it */
    int32_t first_step;       /* sgd: the momentum buffer starts as the gradient (PyTorch) */
    float grad_mul;           /* unscale and clip folded: inv_scale * clip_coef */
    float lr;
    float adam_neg_step;      /* -lr / (1 - beta1^t), t the 1-based step count */
    float adam_bc2_sqrt;      /* sqrt(1 - beta2^t) */
    float adam_decay;         /* 1 - lr * weight_decay (applied where a parameter decays) */
    int64_t t;                /* the step's 1-based optimizer step count (stochastic rounding's key) */
};

/* One step's log row (the device part of a scale_log.csv row and what the fail-fast checks read). */
struct step_row {
    int64_t step;             /* 1-based */
    double loss;              /* mean over the micro-batches (of every rank) of each one's mean row loss */
    double scale;             /* the scale the step ran with */
    double scale_next;        /* after the update */
    double grad_norm;         /* unscaled; NaN when non-finite */
    double clip_coef;
    double lr;                /* applied; 0 when skipped */
    int64_t found_inf, skipped, skips_total, consecutive_skips;
    int64_t update_nonfinite; /* skipped because the update would have stored a non-finite weight or moment: 1 +
                               * the first such parameter's index (grad_check.update_nonfinite), else 0 */
    int64_t grad_zeros;       /* zeros of the sampled activation gradients: count_zeros adds them here (the
                               * trainer's running row, zeroed at a window's start and by window_store after each
                               * step; step_rule_finish leaves it) */
};

/* The largest magnitudes of the optimizer state as the last applied update stored it, in backend memory (+Inf: not
 * known, as before a run's first step): the updates raise them over every element they store
 * (optim_update_args.bound) after step_rule_finish zeroed them for a taken step; a skipped step leaves them. */
struct state_bound {
    float pmax;               /* max |weight| */
    float mmax;               /* max |AdamW's first moment| or |SGD's momentum buffer| */
    float vmax;               /* max of AdamW's second moment */
};

/* The training state the step rule owns, in backend memory. The host keeps a mirror (trainer.scaler,
 * optimizer.step, trainer.step) that it writes before a log window and reads back after it. */
struct step_state {
    struct scaler scaler;
    int64_t step;             /* optimizer steps attempted */
    int64_t opt_step;         /* optimizer steps taken (the schedule's t; AdamW's step count) */
    double loss_acc;          /* backend->loss_sum accumulates the micro-batches' losses here (then summed over
                               * the ranks) */
    float seed;               /* the loss gradient's seed for the next step: scale / (accum_steps x world) */
    struct step_scalars sc;   /* the decision of the last finished step */
    struct state_bound bound; /* the optimizer state's magnitudes, for step_rule_bounded */
    int64_t window_slot;      /* the log window's next row (backend.h window_store): 0 at a window's start */
};

/* The loss gradient's seed for a step run at the scaler's current scale. */
AMP_HD static inline float step_rule_seed(const struct scaler *s, int64_t micro_batches)
{
    return scaler_loss_scale(s) / (float)micro_batches;
}

/* The optimizer scalars of a step taken at learning rate `lr` as step `t` (1-based). */
AMP_HD static inline void step_rule_scalars(struct step_scalars *sc, const struct step_params *p, float lr,
                                            int64_t t, float grad_mul)
{
    double bc1 = 1.0 - pow(p->beta1, (double)t);
    double bc2 = 1.0 - pow(p->beta2, (double)t);
    sc->skip = 0;
    sc->check = 0;
    sc->first_step = t == 1;
    sc->grad_mul = grad_mul;
    sc->lr = lr;
    sc->adam_neg_step = (float)(-(double)lr / bc1);
    sc->adam_bc2_sqrt = (float)sqrt(bc2);
    sc->adam_decay = (float)(1.0 - (double)lr * (double)p->weight_decay);
    sc->t = t;
}

/* The unscaled norm, the clip coefficient and the learning rate of a step whose gradients are finite. */
AMP_HD static inline void step_rule_decide(const struct step_params *p, const struct step_state *st,
                                           const struct grad_check *gc, float inv, double *norm, double *coef,
                                           double *lr)
{
    double raw = p->inf_norm ? gc->absmax : sqrt(gc->sumsq);
    *norm = raw * (double)inv;
    *coef = 1.0;
    if (p->max_norm > 0)
        *coef = fmin(1.0, p->max_norm / (*norm + 1e-6));
    *lr = schedule_lr(&p->schedule, st->opt_step);
}

/* Whether the update with scalars sc, on finite gradients of max |g| gc->absmax and a state within b, stores only
 * finite weights and moments, proved from bounds: each value's magnitude bounded term by term in double, with 1%
 * for fp32's and bf16's roundings, against 3e38 (below fp32's largest value and bf16's largest finite one, so
 * neither a rounding to nearest nor a stochastic one reaches Inf). AdamW's step is bounded by |m| / eps (its
 * denominator is at least eps). A bound that is not finite, or eps 0, proves nothing: the trial decides. */
AMP_HD static inline int step_rule_bounded(const struct step_params *p, const struct step_scalars *sc,
                                           const struct grad_check *gc, const struct state_bound *b)
{
    const double top = 3.0e38, k = 1.01;
    double P = b->pmax, M = b->mmax, V = b->vmax;
    double G = gc->absmax * fabs((double)sc->grad_mul) * k;
    if (p->sgd) {
        double mom = p->momentum, g = (G + fabs((double)p->weight_decay) * P) * k;
        double buf = mom != 0 ? (mom * M + g) * k : 0;
        double d = (p->nesterov ? g + mom * buf : mom != 0 ? buf : g) * k;
        double np = (P + fabs((double)sc->lr) * d) * k;
        return G < top && g < top && buf < top && d < top && np < top;
    }
    if (!(p->eps > 0))
        return 0;
    double m = (p->beta1 * M + (1.0 - p->beta1) * G) * k;
    double v = (p->beta2 * V + (1.0 - p->beta2) * G * G) * k;
    double step = fabs((double)sc->adam_neg_step) * m * k;
    double np = (P * fmax(1.0, fabs((double)sc->adam_decay)) + step / p->eps) * k;
    return G < top && m < top && v < top && step < top && np < top;
}

/* The scalars step st->step + 1 would update with, into st->sc, committing nothing (skip where the gradients
 * are not finite), and whether a trial must check them (sc.check: the state's bound does not prove the update
 * finite): the trial updates run on them and report into gc->update_nonfinite, which this zeroes, before
 * step_rule_finish decides. A weight or moment is never written non-finite (docs/precision.md). */
AMP_HD static inline void step_rule_propose(const struct step_params *p, struct step_state *st,
                                            struct grad_check *gc)
{
    float inv = scaler_inv_scale(&st->scaler);
    double norm, coef, lr;
    gc->update_nonfinite = 0;
    if (gc->found_nonfinite) {
        st->sc.skip = 1;
        return;
    }
    step_rule_decide(p, st, gc, inv, &norm, &coef, &lr);
    step_rule_scalars(&st->sc, p, (float)lr, st->opt_step + 1, (float)((double)inv * coef));
    st->sc.check = !step_rule_bounded(p, &st->sc, gc, &st->bound);
}

/* Finish step st->step + 1 (docs/precision.md, "One optimizer step"): inv = 1/scale; norm and clip coefficient from the
 * finite totals; skip when non-finite (the schedule and step count stay), or when the trial found that the
 * update would store a non-finite weight or moment (counted as a skip; the scale stays), else the scalars
 * for the update; the scale update; the log row; the next step's seed. */
AMP_HD static inline void step_rule_finish(const struct step_params *p, struct step_state *st,
                                           const struct grad_check *gc, struct step_row *row)
{
    float inv = scaler_inv_scale(&st->scaler);
    int nonfinite = gc->found_nonfinite != 0;
    int bad_update = !nonfinite && gc->update_nonfinite != 0;
    double norm = NAN, coef = 1.0, lr = 0.0;
    if (!nonfinite)
        step_rule_decide(p, st, gc, inv, &norm, &coef, &lr);
    if (!nonfinite && !bad_update) {
        st->opt_step++;
        step_rule_scalars(&st->sc, p, (float)lr, st->opt_step, (float)((double)inv * coef));
        st->bound.pmax = st->bound.mmax = st->bound.vmax = 0.0f; /* the updates raise them again */
    } else {
        st->sc.skip = 1;
        lr = 0.0;
    }
    row->step = st->step + 1;
    row->loss = st->loss_acc / (double)p->micro_batches;
    row->scale = st->scaler.scale;
    row->found_inf = nonfinite;
    row->update_nonfinite = bad_update ? gc->update_nonfinite : 0;
    row->skipped = bad_update ? scaler_skip(&st->scaler) : scaler_update(&st->scaler, nonfinite, st->step + 1);
    row->skips_total = st->scaler.skips_total;
    row->consecutive_skips = st->scaler.consecutive_skips;
    row->scale_next = st->scaler.scale;
    row->grad_norm = norm;
    row->clip_coef = coef;
    row->lr = lr;
    st->seed = step_rule_seed(&st->scaler, p->micro_batches);
    st->step++;
}

#endif
