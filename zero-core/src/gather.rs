//! The order in which one micro-step runs the model's modules, and at stage 3 which gather
//! units each one needs and how long they stay gathered: what the engine executes and what the
//! memory model and the schedule book.
//!
//! - **Modules** run in [`ModelDesc::module_order`](crate::ModelDesc::module_order). With
//!   activation checkpointing the backward visits them in reverse, recomputing each one, but
//!   only from [`GatherOrder::backward_from`] on: the modules before it read no trainable
//!   parameter and their input carries no gradient (a frozen prefix, as in fine-tuning), so
//!   they are neither recomputed nor back-propagated.
//! - **Needs.** A module needs its own gather units and the gather units of the parameters it
//!   reads from other modules ([`crate::ParamDesc::readers`]: tied weights).
//! - **Lifetimes** (stage 3, activation checkpointing). A unit read by one module is gathered
//!   for its forward and released after it, then gathered again for its recompute and released
//!   after its backward. A *shared* unit (read by several modules) is gathered once, at its
//!   first reader's forward, and stays until the backward of the lowest reader that runs one
//!   ([`GatherOrder::kept_until`]); if no reader runs a backward, it is released after the last
//!   reader's forward. A shared unit is therefore never gathered for the backward.
//! - **Prefetch.** Once a module's units are gathered, the first unit of the next module that
//!   needs any (forward), or the last unit of the previous one (backward, within the modules
//!   that run one), is prefetched when [`Plan::may_prefetch`] allows it
//!   ([`GatherOrder::prefetch`]).
//!
//! Without activation checkpointing every unit gathered by the forward stays until the backward
//! is done.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use crate::plan::{Plan, UnitKind};

/// How a micro-step visits the modules and, at stage 3, their gather units.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GatherOrder {
    /// The modules, in the order the forward runs them.
    pub modules: Vec<String>,
    /// Per module: the gather units its forward and recompute need (its own and the shared
    /// units it reads), in plan order. Empty below stage 3.
    pub needs: Vec<Vec<usize>>,
    /// The first module whose backward runs; the modules before it take no gradient. Equal to
    /// `modules.len()` when no module reads a trainable parameter.
    pub backward_from: usize,
    /// Per unit: for a shared gather unit read by a module that runs a backward, the module
    /// after whose backward it is released (it stays gathered from its first reader's forward
    /// until then); `None` for every other unit.
    pub kept_until: Vec<Option<usize>>,
    /// Per unit: the last module whose forward reads a gather unit; `None` for other units.
    pub last_reader: Vec<Option<usize>>,
}

impl GatherOrder {
    /// Whether gather unit `u` is gathered again for the backward (activation checkpointing):
    /// a unit read by one module that runs a backward. Shared units stay from the forward.
    pub fn backward_gather(&self, u: usize) -> bool {
        self.kept_until[u].is_none() && self.last_reader[u].is_some_and(|m| m >= self.backward_from)
    }

    /// The unit to prefetch once module `m`'s units are gathered: the first unit of the next
    /// module that needs any (`backward`: the last unit of the previous one that runs a
    /// backward), if the plan allows prefetching it while `m`'s last unit is live.
    pub fn prefetch(&self, plan: &Plan, m: usize, backward: bool) -> Option<usize> {
        let &last = self.needs.get(m)?.last()?;
        let next = if backward {
            (self.backward_from..m)
                .rev()
                .find_map(|k| self.needs[k].last())
        } else {
            self.needs.iter().skip(m + 1).find_map(|v| v.first())
        };
        let units = plan.units();
        next.copied()
            .filter(|&n| plan.may_prefetch(units[last].len, units[n].len))
    }

    /// Whether unit `u` is released after module `m`'s forward in a training micro-step with
    /// activation checkpointing (`training`), or in a forward that no backward follows.
    pub fn released_after_forward(&self, u: usize, m: usize, training: bool) -> bool {
        self.last_reader[u] == Some(m) && (!training || self.kept_until[u].is_none())
    }

    /// Whether unit `u` is released after module `m`'s backward (activation checkpointing).
    pub fn released_after_backward(&self, u: usize, m: usize) -> bool {
        match self.kept_until[u] {
            Some(k) => k == m,
            None => true,
        }
    }
}

impl Plan {
    /// The modules' order, what each needs, and how long shared units stay (see the module
    /// docs).
    pub fn gather_order(&self) -> GatherOrder {
        let model = self.model();
        let modules: Vec<String> = model.module_order().into_iter().map(String::from).collect();
        let index: HashMap<&str, usize> = modules
            .iter()
            .enumerate()
            .map(|(i, m)| (m.as_str(), i))
            .collect();
        let at = |m: &str| index.get(m).copied().unwrap_or(usize::MAX);
        // A module runs a backward from the first one that reads a trainable parameter on.
        let backward_from = model
            .params
            .iter()
            .filter(|p| p.trainable)
            .flat_map(|p| std::iter::once(&p.module).chain(&p.readers))
            .map(|m| at(m))
            .min()
            .unwrap_or(modules.len())
            .min(modules.len());
        let units = self.units();
        let mut needs = vec![Vec::new(); modules.len()];
        let mut kept_until = vec![None; units.len()];
        let mut last_reader = vec![None; units.len()];
        for (u, unit) in units.iter().enumerate() {
            if unit.kind != UnitKind::Gather {
                continue;
            }
            let mut readers: Vec<usize> = std::iter::once(&unit.module)
                .chain(&unit.readers)
                .map(|m| at(m))
                .filter(|&m| m < modules.len())
                .collect();
            readers.sort_unstable();
            for &m in &readers {
                needs[m].push(u);
            }
            last_reader[u] = readers.last().copied();
            if readers.len() > 1 {
                kept_until[u] = readers.iter().copied().find(|&m| m >= backward_from);
            }
        }
        GatherOrder {
            modules,
            needs,
            backward_from,
            kept_until,
            last_reader,
        }
    }

    /// Peak gathered elements at stage 3 (0 otherwise). Without activation checkpointing, every
    /// gather unit (the forward's gathers stay for the backward). With it, the most elements
    /// gathered at once as [`GatherOrder`] runs the modules: a module's needed units, the shared
    /// units still kept, and the unit being prefetched.
    pub fn peak_gathered(&self) -> u64 {
        if self.stage() != 3 {
            return 0;
        }
        let units = self.units();
        if !self.config().recompute() {
            return units
                .iter()
                .filter(|u| u.kind == UnitKind::Gather)
                .map(|u| u.len)
                .sum();
        }
        let o = self.gather_order();
        let len = |u: usize| units[u].len;
        let mut live = BTreeSet::new();
        let mut peak = 0;
        let mut visit = |live: &mut BTreeSet<usize>, m: usize, backward: bool| {
            live.extend(o.needs[m].iter().copied());
            live.extend(o.prefetch(self, m, backward));
            peak = peak.max(live.iter().map(|&u| len(u)).sum::<u64>());
        };
        let count = o.modules.len();
        for m in 0..count {
            visit(&mut live, m, false);
            live.retain(|&u| !(o.needs[m].contains(&u) && o.released_after_forward(u, m, true)));
        }
        for m in (o.backward_from..count).rev() {
            visit(&mut live, m, true);
            live.retain(|&u| !(o.needs[m].contains(&u) && o.released_after_backward(u, m)));
        }
        peak
    }
}

#[cfg(test)]
mod tests {
    use crate::{ModelDesc, ParamDesc, Plan, Topology, ZeroConfig};

    /// A tied GPT in four modules: `emb` (the embedding `e`, read by `head` too, and a position
    /// table `p`), two blocks, and `head` (a norm `n`, and `e` again).
    fn tied(frozen_emb: bool) -> ModelDesc {
        let mut e = ParamDesc::new("e", &[8, 4], "emb").read_by(["head"]);
        let mut p = ParamDesc::new("p", &[4, 4], "emb");
        if frozen_emb {
            e = e.frozen();
            p = p.frozen();
        }
        ModelDesc::new(vec![
            e,
            p,
            ParamDesc::new("b0", &[12], "block0"),
            ParamDesc::new("b1", &[12], "block1"),
            ParamDesc::new("n", &[4], "head"),
        ])
    }

    fn plan(model: &ModelDesc, recompute: bool) -> Plan {
        let cfg = ZeroConfig {
            stage: 3,
            param_persistence_threshold: 0,
            checkpoint_activations: Some(recompute),
            ..Default::default()
        };
        Plan::new(model, Topology::single_node(2).unwrap(), &cfg).unwrap()
    }

    #[test]
    fn a_tied_weight_gets_a_unit_of_its_own_kept_until_its_owners_backward() {
        let p = plan(&tied(false), true);
        let names: Vec<(&str, &[String])> = p
            .units()
            .iter()
            .map(|u| (u.module.as_str(), u.readers.as_slice()))
            .collect();
        assert_eq!(names.len(), 5, "{names:?}");
        assert_eq!(names[0], ("emb", &["head".to_string()][..]));
        let o = p.gather_order();
        assert_eq!(o.modules, ["emb", "block0", "block1", "head"]);
        assert_eq!(o.needs, vec![vec![0, 1], vec![2], vec![3], vec![0, 4]]);
        assert_eq!(o.backward_from, 0);
        assert_eq!(o.kept_until, vec![Some(0), None, None, None, None]);
        assert!(
            !o.backward_gather(0),
            "the shared unit stays from the forward"
        );
        assert!((1..5).all(|u| o.backward_gather(u)));
        // Lengths 32, 16, 12, 12 and 4 (4-aligned at N = 2). The peak is the embedding's forward
        // (and its backward): e and p, with block0's unit prefetched. The shared e stays live
        // throughout; without it the head's forward would hold 4 elements.
        let lens: Vec<u64> = p.units().iter().map(|u| u.len).collect();
        assert_eq!(lens, [32, 16, 12, 12, 4]);
        assert_eq!(p.peak_gathered(), 32 + 16 + 12);
    }

    #[test]
    fn a_frozen_prefix_runs_no_backward_and_keeps_a_shared_unit_until_a_reader_does() {
        let p = plan(&tied(true), true);
        let o = p.gather_order();
        assert_eq!(o.backward_from, 1, "emb reads nothing trainable");
        // e is read by head, which runs a backward: kept until head's backward.
        assert_eq!(o.kept_until[0], Some(3));
        assert!(!o.backward_gather(1), "p's module runs no backward");
        let back: Vec<usize> = p
            .schedule()
            .iter()
            .filter(|op| op.phase == crate::Phase::Backward)
            .filter_map(|op| op.unit)
            .collect();
        assert_eq!(
            back,
            vec![4, 3, 2],
            "block1's, block0's and the norm's units only"
        );
    }

    #[test]
    fn without_checkpointing_every_gather_unit_stays() {
        let p = plan(&tied(false), false);
        let all: u64 = p.units().iter().map(|u| u.len).sum();
        assert_eq!(p.peak_gathered(), all);
    }

    #[test]
    fn a_reader_that_owns_nothing_needs_the_module_order() {
        let mut m = ModelDesc::new(vec![
            ParamDesc::new("e", &[4], "emb").read_by(["head"]),
            ParamDesc::new("b", &[4], "block"),
        ]);
        let err = m.validate().unwrap_err().to_string();
        assert!(err.contains("owns no parameter"), "{err}");
        m.modules = vec!["emb".into(), "block".into(), "head".into()];
        m.validate().unwrap();
        let o = plan(&m, true).gather_order();
        assert_eq!(o.needs, vec![vec![0], vec![1], vec![0]]);
    }
}
