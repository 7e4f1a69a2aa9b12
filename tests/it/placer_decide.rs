//! The placement decision on a realistic cluster: a forest fitted on the bundled
//! Gavel measurements and the evaluation crate's synthetic cluster (which the
//! placer's own unit tests cannot use: the evaluation crate depends on the placer).

use std::sync::Arc;

use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_eval::{SyntheticCluster, samples_from_gavel};
use iadeep_placer::{Assessment, ModelledMemory, Placer, PlacerParams};
use iadeep_predictor::{ForestParams, LearnerParams, OnlinePredictor, Prediction, SlowdownModel};
use iadeep_proto::{CoLocationSample, TaskProfile};

/// The fitted predictor, hiding its pairwise composition: every resident is
/// predicted over its whole co-runner list, as before the prefixes were reused.
#[derive(Debug)]
struct WholeLists(Arc<OnlinePredictor>);

impl SlowdownModel for WholeLists {
    fn predict(&self, kind: &str, task: &TaskProfile, co: &[TaskProfile]) -> Prediction {
        self.0.predict(kind, task, co)
    }
    fn observe(&self, _: &CoLocationSample) {}
    fn version(&self) -> Option<u64> {
        self.0.version()
    }
}

/// Each candidate's device and its predicted Σ PD increase and uncertainty, bit for bit.
fn bits<'v>(a: &Assessment<'v>) -> Vec<(&'v str, u64, u64)> {
    let mut c: Vec<_> = a
        .candidates
        .iter()
        .map(|c| {
            (
                c.device_id,
                c.pd_increase.to_bits(),
                c.uncertainty.to_bits(),
            )
        })
        .collect();
    c.sort_unstable();
    c
}

/// Reusing the residents' pairwise predictions changes no decision and no
/// explanation, bit for bit: a forest fitted on the bundled Gavel K80
/// measurements, a seeded synthetic cluster, and many arrivals, each decided
/// twice so the second decision runs on the cached prefixes.
#[test]
fn reusing_the_residents_pairs_changes_no_decision() {
    let gavel = GavelThroughputs::bundled().expect("bundled Gavel");
    let worker = gavel.worker("k80").expect("k80 measurements");
    let samples = samples_from_gavel(worker, "k80").samples;
    let params = LearnerParams {
        forest: ForestParams {
            n_trees: 8,
            ..Default::default()
        },
        ..Default::default()
    };
    let predictor = Arc::new(OnlinePredictor::from_samples(params, samples).expect("fit"));
    assert!(predictor.model_samples() > 0, "the forest is fitted");
    let cluster = SyntheticCluster::new(120, 300, 7);
    let reused_view = cluster.view(Arc::new(ModelledMemory));
    let whole_view = cluster.view(Arc::new(ModelledMemory));
    let reused = Placer::new(PlacerParams::default(), predictor.clone()).expect("valid");
    let whole = Placer::new(
        PlacerParams::default(),
        Arc::new(WholeLists(predictor.clone())),
    )
    .expect("valid");
    assert!(
        reused_view
            .devices()
            .any(|(_, d)| d.summary().profiles.len() >= 3),
        "the cluster has devices with several residents"
    );
    let now = 1_000;
    for round in 0..2 {
        for i in 0..40 {
            let task = cluster.arrival(i);
            let a = reused.assess(&reused_view, &task, &[], now);
            let b = whole.assess(&whole_view, &task, &[], now);
            assert_eq!(bits(&a), bits(&b), "round {round}, arrival {i}");
            assert_eq!(a.rejected, b.rejected, "round {round}, arrival {i}");
            assert_eq!(
                reused.decide(&reused_view, &task, &[], now),
                whole.decide(&whole_view, &task, &[], now),
                "round {round}, arrival {i}"
            );
        }
    }
    // The reused path was taken: the cache holds prefixes for shared devices.
    assert!(reused_view.devices().any(|(_, d)| {
        let residents = d.summary().profiles.len();
        residents >= 2 && d.cached_pairwise_prefixes(predictor.generation()) == Some(residents)
    }));
}
