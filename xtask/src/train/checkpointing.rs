//! `train`'s checkpoint flags (`--save-every`, `--save-dir`, `--resume`, `--reshard`) turned into
//! the run's save and resume stores, every refusal made before a rank starts.

use std::path::Path;

use anyhow::{Context, bail};

use super::TrainArgs;

/// The run's checkpointing from the flags: the save and resume stores, checked before any rank
/// starts (a resume needs a committed checkpoint).
pub(super) fn checkpointing(
    a: &TrainArgs,
    out: &Path,
    steps: u64,
) -> anyhow::Result<Option<zero_burn::demo::run::Checkpointing>> {
    use std::sync::Arc;
    use zero_burn::checkpoint::{DirStorage, Storage, read_manifest};
    if a.reshard && a.resume.is_none() {
        bail!("--reshard needs --resume DIR (it reshards the checkpoint being loaded)");
    }
    if a.save_every == Some(0) {
        bail!("--save-every 0: expected a number of steps of at least 1");
    }
    // The resumed checkpoint, read and checked before any rank starts.
    let resumed = match &a.resume {
        None => None,
        Some(dir) => {
            anyhow::ensure!(
                dir.is_dir(),
                "--resume {}: no such directory",
                dir.display()
            );
            let (store, tag) = crate::ckpt::locate(dir)?;
            let (tag, m) = read_manifest(&store, tag.as_deref())
                .with_context(|| format!("--resume {}: no checkpoint to resume", dir.display()))?;
            let step = m.scalars.step;
            if step >= steps {
                bail!(
                    "--resume {}: the checkpoint is at step {step} and --steps is {steps}, so \
                     nothing is left to train (--steps counts every step, the checkpoint's too)",
                    dir.display()
                );
            }
            Some((store, tag, step))
        }
    };
    let save_dir = a
        .save_dir
        .clone()
        .or_else(|| resumed.as_ref().map(|(s, ..)| s.root().to_path_buf()))
        .or_else(|| a.save_every.map(|_| out.join("checkpoints")));
    if save_dir.is_none() && resumed.is_none() {
        return Ok(None);
    }
    let first_step = resumed.as_ref().map_or(0, |(_, _, step)| *step);
    if let Some(d) = &save_dir {
        // Another run's checkpoints are not taken over: saving there would move its LATEST and
        // leave its tags to `ckpt gc`. Only the resumed root itself is continued, and nothing is
        // saved inside a checkpoint (a root or a committed tag).
        let resuming_here = resumed
            .as_ref()
            .is_some_and(|(s, ..)| crate::ckpt::same_place(s.root(), d));
        match crate::ckpt::enclosing_checkpoint(d) {
            Some(c) if crate::ckpt::same_place(&c, d) && resuming_here => {}
            Some(c) if crate::ckpt::same_place(&c, d) && d.join("LATEST").is_file() => bail!(
                "--save-dir {} already holds another run's checkpoints (its LATEST): resume it \
                 with --resume {0}, or save somewhere else",
                d.display()
            ),
            Some(c) => bail!(
                "--save-dir {} is, or lies inside, the checkpoint {}: save somewhere else",
                d.display(),
                c.display()
            ),
            None => {}
        }
        // A committed checkpoint is never rewritten: a run resumed from an older tag would
        // collide with the later tags already there. Refuse it now rather than at that save.
        let every = a.save_every.unwrap_or(0);
        let saves_at = |s: u64| {
            s > first_step && s <= steps && (s == steps || (every > 0 && s.is_multiple_of(every)))
        };
        let clash = std::fs::read_dir(d)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
            .filter(|s| saves_at(*s))
            .min();
        if let Some(step) = clash {
            bail!(
                "{} already holds {}, which this run would save again (committed checkpoints \
                 are never rewritten): pass another --save-dir, or resume its LATEST",
                d.display(),
                zero_core::checkpoint::Manifest::tag_of(step)
            );
        }
    }
    let save: Option<Arc<dyn Storage>> = match &save_dir {
        Some(d) => {
            let store = DirStorage::new(d)
                .with_context(|| format!("cannot create checkpoint directory {}", d.display()))?;
            super::check_writable(d, "the checkpoint directory")?;
            Some(Arc::new(store))
        }
        None => None,
    };
    let (resume, resume_tag) = match resumed {
        None => (None, None),
        Some((store, tag, step)) => {
            // Under a launcher every process reads it; one says so.
            let quiet = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"]
                .iter()
                .any(|v| std::env::var(v).is_ok_and(|r| r != "0"));
            if !quiet {
                eprintln!(
                    "resuming from {tag} (step {step}) in {}",
                    store.root().display()
                );
            }
            (Some(Arc::new(store) as Arc<dyn Storage>), Some(tag))
        }
    };
    Ok(Some(zero_burn::demo::run::Checkpointing {
        save,
        save_every: a.save_every.unwrap_or(0),
        resume,
        resume_tag,
        reshard: a.reshard,
    }))
}
