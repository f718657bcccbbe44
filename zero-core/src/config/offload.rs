//! DeepSpeed's offload keys: `zero_optimization.offload_optimizer` and `offload_param` (with the
//! older `cpu_offload*` flags) become [`ZeroConfig::optimizer_placement`],
//! [`ZeroConfig::param_placement`], [`ZeroConfig::nvme_path`] and
//! [`ZeroConfig::offload_buffer_count`]; the `aio` section is read for its `use_gds`. Every key
//! is honoured, or named in a note saying why it has no effect here, or refused with the reason.

use serde_json::Value;

use super::json::int;
use super::{Placement, ZeroConfig};

/// Which part of the model states an offload section places.
#[derive(Clone, Copy)]
enum Part {
    Optimizer,
    Param,
}

/// Reads `zero_optimization.{k}` when `k` is an offload key; false for any other key. `ring`
/// collects the sections' `buffer_count`s: both share one ring here, so the caller sets
/// [`ZeroConfig::offload_buffer_count`] to the larger.
pub(super) fn read_offload(
    k: &str,
    val: &Value,
    c: &mut ZeroConfig,
    ring: &mut Option<u32>,
    notes: &mut Vec<String>,
    bad: &mut Vec<String>,
) -> bool {
    let (part, flag) = match k {
        "offload_optimizer" => (Part::Optimizer, false),
        "offload_param" => (Part::Param, false),
        "cpu_offload" => (Part::Optimizer, true),
        "cpu_offload_params" => (Part::Param, true),
        "cpu_offload_use_pin_memory" => {
            notes.push(pin_memory_note(k));
            return true;
        }
        _ => return false,
    };
    let key = format!("zero_optimization.{k}");
    if flag {
        match val {
            Value::Bool(on) => place(part, *on, Placement::Host, c, &key, notes),
            _ => bad.push(format!("{key}: got {val}, expected true or false")),
        }
        return true;
    }
    let obj = match val {
        Value::Null => {
            notes.push(format!("{key}: disabled, as here"));
            return true;
        }
        Value::Object(obj) => obj,
        _ => {
            bad.push(format!(
                "{key}: got {val}, expected an object such as {{\"device\": \"cpu\"}}"
            ));
            return true;
        }
    };
    let device = match obj.get("device").map(|d| (d, d.as_str())) {
        None | Some((_, Some("none"))) => None,
        Some((_, Some("cpu"))) => Some(Placement::Host),
        Some((_, Some("nvme"))) => Some(Placement::Nvme),
        Some((d, _)) => {
            bad.push(format!(
                "{key}.device: got {d}, expected \"none\", \"cpu\" or \"nvme\""
            ));
            return true;
        }
    };
    let Some(device) = device else {
        notes.push(format!("{key}: disabled, as here"));
        return true;
    };
    place(part, true, device, c, &key, notes);
    for (sub, v) in obj {
        let at = format!("{key}.{sub}");
        match (sub.as_str(), part) {
            ("device", _) => {}
            ("nvme_path", _) => nvme_path(&at, v, device, c, bad),
            ("buffer_count", _) => match int(v).and_then(|n| u32::try_from(n).ok()) {
                Some(n) => *ring = Some(ring.map_or(n, |r| r.max(n))),
                None => bad.push(format!("{at}: got {v}, expected a whole number of buffers")),
            },
            ("pin_memory", _) => notes.push(pin_memory_note(&at)),
            ("buffer_size", Part::Param) => notes.push(format!(
                "{at}: accepted; the NVMe ring's buffers are sized to the largest unit here"
            )),
            ("max_in_cpu", Part::Param) => notes.push(format!(
                "{at}: accepted; with NVMe placement zero-rs keeps no parameters in host \
                 memory beyond the ring"
            )),
            ("fast_init", Part::Optimizer) => notes.push(format!(
                "{at}: accepted; it tunes DeepSpeed's start-up and has no effect here"
            )),
            ("ratio", Part::Optimizer) if v.as_f64() == Some(1.0) => {}
            ("ratio", Part::Optimizer) => bad.push(format!(
                "{at}: got {v}, expected 1.0 (a partial offload is not supported by zero-rs)"
            )),
            _ => bad.push(format!("unknown key `{at}`")),
        }
    }
    true
}

/// Sets the placement `part` takes (`on`), with a note saying where it now lives.
fn place(
    part: Part,
    on: bool,
    device: Placement,
    c: &mut ZeroConfig,
    key: &str,
    notes: &mut Vec<String>,
) {
    if !on {
        notes.push(format!("{key}: disabled, as here"));
        return;
    }
    let (field, what) = match part {
        Part::Optimizer => (&mut c.optimizer_placement, "the optimizer state"),
        Part::Param => (&mut c.param_placement, "stage 3's parameter shard"),
    };
    *field = device;
    let where_ = match device {
        Placement::Nvme => "on NVMe",
        _ => "in host memory",
    };
    notes.push(format!("{key}: {what} lives {where_}"));
}

/// `nvme_path`: the store's folder. Both sections must name the same one.
fn nvme_path(at: &str, v: &Value, device: Placement, c: &mut ZeroConfig, bad: &mut Vec<String>) {
    let Some(path) = v.as_str().filter(|p| !p.is_empty()) else {
        bad.push(format!("{at}: got {v}, expected a folder"));
        return;
    };
    if device != Placement::Nvme {
        // DeepSpeed's own examples carry it with `device: "cpu"`: unused, as there.
        return;
    }
    match &c.nvme_path {
        Some(p) if p != path => bad.push(format!(
            "{at}: got {path:?}, expected {p:?}, the folder the other offload section names \
             (zero-rs keeps one NVMe store per rank)"
        )),
        _ => c.nvme_path = Some(path.to_string()),
    }
}

fn pin_memory_note(key: &str) -> String {
    format!("{key}: accepted; host buffers are ordinary allocations here, so it has no effect")
}

/// DeepSpeed's `aio` section: it tunes libaio's queues for NVMe offload. zero-rs's store does its
/// own IO, so the keys have no effect, except GPUDirect Storage (`use_gds`), which it refuses.
pub(super) fn read_aio(val: &Value, notes: &mut Vec<String>, bad: &mut Vec<String>) {
    let Some(obj) = val.as_object() else {
        bad.push(format!("aio: got {val}, expected an object"));
        return;
    };
    for (k, v) in obj {
        match k.as_str() {
            "use_gds" if v.as_bool() == Some(true) => bad.push(format!(
                "aio.use_gds: got {v}, expected false (GPUDirect Storage is not supported by \
                 zero-rs)"
            )),
            "block_size"
            | "queue_depth"
            | "thread_count"
            | "single_submit"
            | "overlap_events"
            | "intra_op_parallelism"
            | "use_gds" => notes.push(format!(
                "aio.{k}: accepted; it tunes libaio, which zero-rs's NVMe store does not use"
            )),
            _ => bad.push(format!("unknown key `aio.{k}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn import(zero: &str) -> Result<ZeroConfig, String> {
        let text = format!(r#"{{"zero_optimization": {{"stage": 3, {zero}}}}}"#);
        ZeroConfig::from_deepspeed_json(&text)
            .map(|i| i.config)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn zero_infinity_s_keys_become_placements() {
        let c = import(
            r#""offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": true,
                "buffer_count": 4, "fast_init": false, "ratio": 1.0},
               "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5,
                "buffer_size": 1e8, "max_in_cpu": 1e9}"#,
        )
        .unwrap();
        assert_eq!(c.optimizer_placement, Placement::Nvme);
        assert_eq!(c.param_placement, Placement::Nvme);
        assert_eq!(c.nvme_path.as_deref(), Some("/nvme"));
        assert_eq!(c.offload_buffer_count, 5);
        let c = import(r#""offload_param": {"device": "cpu", "pin_memory": true}"#).unwrap();
        assert_eq!(c.param_placement, Placement::Host);
        assert_eq!(c.optimizer_placement, Placement::Device);
        let c = import(r#""cpu_offload_params": true, "cpu_offload": true"#).unwrap();
        assert_eq!(
            (c.optimizer_placement, c.param_placement),
            (Placement::Host, Placement::Host)
        );
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        for (zero, key) in [
            (
                r#""offload_optimizer": {"device": "cpu", "ratio": 0.3}"#,
                "offload_optimizer.ratio",
            ),
            (
                r#""offload_param": {"device": "gpu"}"#,
                "offload_param.device",
            ),
            (
                r#""offload_param": {"device": "nvme", "nvme_path": ""}"#,
                "offload_param.nvme_path",
            ),
            (
                r#""offload_param": {"device": "nvme", "ratio": 1.0}"#,
                "`zero_optimization.offload_param.ratio`",
            ),
            (
                r#""offload_param": {"device": "nvme", "nvme_path": "/a"},
                   "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}"#,
                "the other offload section",
            ),
            (
                r#""offload_optimizer": {"device": "nvme", "buffer_count": -1}"#,
                "buffer_count",
            ),
            (r#""cpu_offload": "yes""#, "cpu_offload: got"),
        ] {
            let e = import(zero).unwrap_err();
            assert!(e.contains(key), "{zero}: {e}");
        }
        let text = r#"{"aio": {"block_size": 1048576, "use_gds": true}, "zero_optimization": {}}"#;
        let e = ZeroConfig::from_deepspeed_json(text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("aio.use_gds") && !e.contains("block_size"),
            "{e}"
        );
    }

    #[test]
    fn aio_tunings_are_notes() {
        let text = r#"{"aio": {"block_size": 1048576, "queue_depth": 8, "use_gds": false},
                       "zero_optimization": {"stage": 3}}"#;
        let imp = ZeroConfig::from_deepspeed_json(text).unwrap();
        assert_eq!(
            imp.notes.iter().filter(|n| n.starts_with("aio.")).count(),
            3
        );
    }

    fn plan(c: &ZeroConfig) -> crate::Result<crate::Plan> {
        let model = crate::ModelDesc::preset("gpt2-small").unwrap();
        crate::Plan::new(&model, crate::Topology::new(4, 4).unwrap(), c)
    }

    #[test]
    fn placements_are_checked_before_planning() {
        let at = |stage, param, nvme_path: Option<&str>, buffers| ZeroConfig {
            stage,
            param_placement: param,
            optimizer_placement: Placement::Nvme,
            nvme_path: nvme_path.map(String::from),
            offload_buffer_count: buffers,
            ..ZeroConfig::default()
        };
        for (c, field) in [
            (at(2, Placement::Host, Some("/n"), 4), "param_placement"),
            (at(3, Placement::Device, None, 4), "nvme_path"),
            (at(3, Placement::Device, Some(""), 4), "nvme_path"),
            (
                at(3, Placement::Nvme, Some("/n"), 2),
                "offload_buffer_count",
            ),
        ] {
            let e = plan(&c).unwrap_err().to_string();
            assert!(e.contains(&format!("invalid {field}")), "{e}");
        }
        assert!(plan(&at(3, Placement::Nvme, Some("/n"), 3)).is_ok());
        assert!(plan(&at(1, Placement::Device, Some("/n"), 4)).is_ok());
    }

    #[test]
    fn every_placement_is_booked_where_it_lives() {
        let base = ZeroConfig {
            precision: crate::Precision::Bf16,
            ..ZeroConfig::stage(3)
        };
        let on_device = plan(&base).unwrap().memory();
        assert_eq!((on_device.host_bytes, on_device.disk_bytes), (0, 0));
        assert_eq!(on_device.device_bytes, on_device.total_bytes);
        for (opt, param) in [
            (Placement::Host, Placement::Device),
            (Placement::Device, Placement::Host),
            (Placement::Nvme, Placement::Host),
            (Placement::Host, Placement::Nvme),
            (Placement::Nvme, Placement::Nvme),
        ] {
            let c = ZeroConfig {
                optimizer_placement: opt,
                param_placement: param,
                nvme_path: Some("/n".into()),
                ..base.clone()
            };
            let p = plan(&c).unwrap();
            let m = p.memory();
            let shard = p.shard_len() * p.working_bytes();
            let states = m.optimizer_states + m.master_weights;
            let mut want = [0u64; 3]; // host, disk, ring
            let mut put = |place: Placement, bytes: u64| match place {
                Placement::Device => {}
                Placement::Host => want[0] += bytes,
                Placement::Nvme => want[1] += bytes,
            };
            put(opt, states);
            if opt.is_offloaded() {
                put(Placement::Host, m.gradients);
            }
            put(param, shard);
            let nvme = opt == Placement::Nvme || param == Placement::Nvme;
            assert_eq!(m.offload_buffers > 0, nvme, "{opt:?} {param:?}");
            want[0] += m.offload_buffers;
            assert_eq!(
                [m.host_bytes, m.disk_bytes],
                [want[0], want[1]],
                "{opt:?} {param:?}"
            );
            let text = p.report(0).to_string();
            for split in [
                "of which on the device",
                "of which in host memory",
                "of which on NVMe",
            ] {
                assert!(text.contains(split), "{split}: {text}");
            }
            assert!(
                text.contains(&format!("param_placement = {}", param.name())),
                "{text}"
            );
            // Offloading moves bytes, it does not change the states: the same model states, the
            // device holding less by what left it.
            assert_eq!(m.model_states_bytes, on_device.model_states_bytes);
            assert_eq!(
                m.device_bytes + want[0] + want[1] - m.offload_buffers,
                on_device.device_bytes,
                "{opt:?} {param:?}"
            );
        }
    }

    /// The NVMe ring holds `offload_buffer_count` (at most one per unit) of the largest unit's
    /// optimizer state: the rank's chunk, or at stage 0 (every rank steps whole units) the whole
    /// unit.
    #[test]
    fn the_ring_holds_the_largest_slot_the_rank_steps() {
        for stage in [0u8, 1, 3] {
            let c = ZeroConfig {
                optimizer_placement: Placement::Nvme,
                nvme_path: Some("/n".into()),
                offload_buffer_count: 5,
                ..ZeroConfig::stage(stage)
            };
            let p = plan(&c).unwrap();
            let n = p.world_size() as u64;
            let largest = p.units().iter().map(|u| u.len).max().unwrap();
            let slot = if stage == 0 { largest } else { largest / n };
            let held = p.units().iter().filter(|u| u.trainable).count().min(5) as u64;
            assert!(held >= 1, "stage {stage}");
            // fp32 Adam: two moments, no master.
            assert_eq!(p.memory().offload_buffers, held * slot * 8, "stage {stage}");
        }
    }
}
