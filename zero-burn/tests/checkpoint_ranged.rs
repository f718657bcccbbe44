//! A resharding load reads about what it restores (issue 11): each rank reads only the checksum
//! blocks its part of the state lies in, not every saved file it touches. A 2-rank stage-3
//! checkpoint of one 4096 × 2048 linear layer (rank files of 50 MB, tensors of 17 MB, far larger
//! than the 1 MiB blocks) loaded on 4 ranks: each new rank needs half of one old rank's file,
//! and the four together read about two files (plus the blocks' rounding and the headers),
//! where reading whole files would take four.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use zero_burn::checkpoint::{MemStorage, Storage, read_manifest};
use zero_burn::{Launch, Whole, ZeroEngine};
use zero_core::{Topology, ZeroConfig};

/// A store that counts the bytes it hands out.
#[derive(Debug, Default)]
struct Counting {
    inner: MemStorage,
    read: AtomicU64,
}

impl Counting {
    fn counted(&self, r: zero_burn::Result<Option<Vec<u8>>>) -> zero_burn::Result<Option<Vec<u8>>> {
        if let Ok(Some(b)) = &r {
            self.read.fetch_add(b.len() as u64, Ordering::SeqCst);
        }
        r
    }
}

impl Storage for Counting {
    fn write(&self, path: &str, bytes: &[u8]) -> zero_burn::Result<()> {
        self.inner.write(path, bytes)
    }
    fn sync_file(&self, path: &str) -> zero_burn::Result<()> {
        self.inner.sync_file(path)
    }
    fn rename(&self, from: &str, to: &str) -> zero_burn::Result<()> {
        self.inner.rename(from, to)
    }
    fn sync_dir(&self, dir: &str) -> zero_burn::Result<()> {
        self.inner.sync_dir(dir)
    }
    fn create_dir(&self, dir: &str) -> zero_burn::Result<()> {
        self.inner.create_dir(dir)
    }
    fn read(&self, path: &str) -> zero_burn::Result<Option<Vec<u8>>> {
        self.counted(self.inner.read(path))
    }
    fn size(&self, path: &str) -> zero_burn::Result<Option<u64>> {
        self.inner.size(path)
    }
    fn exists(&self, path: &str) -> zero_burn::Result<bool> {
        self.inner.exists(path)
    }
    fn list(&self, dir: &str) -> zero_burn::Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn read_range(&self, path: &str, offset: u64, len: u64) -> zero_burn::Result<Option<Vec<u8>>> {
        self.counted(self.inner.read_range(path, offset, len))
    }
    fn append(&self, path: &str, bytes: &[u8]) -> zero_burn::Result<()> {
        self.inner.append(path, bytes)
    }
}

fn values<M: Module>(m: &M) -> Vec<Vec<u32>> {
    struct V(Vec<Vec<u32>>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p.val().into_data().try_into_vec_as::<f32>().unwrap();
            self.0.push(v.iter().map(|x| x.to_bits()).collect());
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

#[test]
fn a_reshard_reads_about_what_it_restores() {
    let layer = LinearConfig::new(4096, 2048).init(&Device::flex().autodiff());
    let model = Whole::new(layer, |m: &Linear, x: &Tensor<2>| {
        m.forward(x.clone()).sum().reshape([1])
    });
    let cfg = ZeroConfig {
        stage: 3,
        ..Default::default()
    };
    let store = Counting::default();
    let saved = Launch::new(Topology::single_node(2).unwrap())
        .timeout(Duration::from_secs(60))
        .run_with(&model, |comm, model| {
            let mut e = ZeroEngine::builder(comm, model)
                .config(cfg.clone())
                .build()?;
            e.save(&store, serde_json::json!(null))?;
            Ok(values(&e.consolidated_model()?))
        })
        .unwrap();
    let (_, m) = read_manifest(&store.inner, None).unwrap();
    let rank_file = m.files.iter().map(|f| f.bytes).max().unwrap();
    assert!(
        rank_file > 16 << 20,
        "rank files of {rank_file} bytes are too small to tell"
    );
    store.read.store(0, Ordering::SeqCst);
    let loaded = Launch::new(Topology::single_node(4).unwrap())
        .timeout(Duration::from_secs(60))
        .run_with(&model, |comm, model| {
            let mut e = ZeroEngine::builder(comm, model)
                .config(cfg.clone())
                .build()?;
            e.load_resharded(&store)?;
            Ok(values(&e.consolidated_model()?))
        })
        .unwrap();
    let read = store.read.load(Ordering::SeqCst);
    println!(
        "reshard 2 -> 4 ranks: {read} bytes read by the 4 ranks, rank files of {rank_file} bytes \
         ({:.2} of reading the file each rank touches whole)",
        read as f64 / (4 * rank_file) as f64
    );
    assert_eq!(loaded[0], saved[0], "the weights came back");
    // Each rank restores half of one old file; block rounding and the headers add little.
    assert!(
        read < 4 * rank_file * 65 / 100,
        "the 4 ranks read {read} bytes; whole files would be {}",
        4 * rank_file
    );
    assert!(
        read >= 2 * rank_file * 9 / 10,
        "{read} bytes cannot hold the state"
    );
}
