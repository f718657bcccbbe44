//! Charts as SVG with plotters: line panels side by side, one line (with markers) per series
//! (`simulate`'s sweeps), and `train`'s report figure (the loss per step beside grouped bars of
//! measured against planned memory).

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

/// One line.
#[derive(Clone, Debug)]
pub(crate) struct Series {
    /// Legend entry.
    pub(crate) name: String,
    /// (x, y) points in x order.
    pub(crate) points: Vec<(f64, f64)>,
}

/// One chart.
#[derive(Clone, Debug)]
pub(crate) struct Panel {
    /// Caption.
    pub(crate) title: String,
    /// X axis label.
    pub(crate) x_label: String,
    /// Y axis label.
    pub(crate) y_label: String,
    /// Names for x = 0, 1, 2, … instead of numbers (categorical axes).
    pub(crate) x_names: Option<Vec<String>>,
    /// The lines.
    pub(crate) series: Vec<Series>,
}

/// Grouped bars: one group per category, one bar per series in it.
#[derive(Clone, Debug)]
pub(crate) struct Bars {
    /// Caption.
    pub(crate) title: String,
    /// Y axis label.
    pub(crate) y_label: String,
    /// The categories, left to right.
    pub(crate) categories: Vec<String>,
    /// `(legend entry, one value per category)`.
    pub(crate) series: Vec<(String, Vec<f64>)>,
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// Draws `panels` side by side into an SVG file of `width × height` pixels.
pub(crate) fn line_charts_svg(
    path: &Path,
    panels: &[Panel],
    width: u32,
    height: u32,
) -> anyhow::Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("cannot draw {}: {e}", path.display());
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (area, p) in areas.iter().zip(panels) {
        draw_lines(area, p, SeriesLabelPosition::LowerRight).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Draws the `lines` panels left to right, then `bars`, side by side into an SVG file of
/// `width × height`.
pub(crate) fn lines_and_bars_svg(
    path: &Path,
    lines: &[Panel],
    bars: &Bars,
    width: u32,
    height: u32,
) -> anyhow::Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("cannot draw {}: {e}", path.display());
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((1, lines.len() + 1));
    for (area, p) in areas.iter().zip(lines) {
        draw_lines(area, p, SeriesLabelPosition::UpperRight).map_err(|e| err(&e))?;
    }
    if let Some(area) = areas.last() {
        draw_bars(area, bars).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

fn draw_lines(area: &Area<'_>, p: &Panel, legend: SeriesLabelPosition) -> DrawResult {
    let pts = || p.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), q| {
        (a.min(q.0), b.max(q.0))
    });
    let y1 = pts().fold(0.0f64, |a, q| a.max(q.1));
    if !(x0.is_finite() && x1.is_finite()) {
        (x0, x1) = (0.0, 1.0);
    }
    let pad = ((x1 - x0) * 0.05).max(0.5);
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), 0.0..y1)?;
    let names = p.x_names.clone();
    let fmt_x = move |x: &f64| match &names {
        Some(n) if (x.round() - x).abs() < 1e-9 && *x >= 0.0 => {
            n.get(x.round() as usize).cloned().unwrap_or_default()
        }
        Some(_) => String::new(),
        None => format!("{x}"),
    };
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(p.x_label.as_str())
        .y_desc(p.y_label.as_str())
        .x_label_formatter(&fmt_x)
        .y_label_formatter(&|y| format_si(*y));
    if let Some(n) = &p.x_names {
        mesh.x_labels(n.len() * 2 + 1);
    }
    mesh.draw()?;
    for (i, s) in p.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(s.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        // Markers only where they can be told apart.
        if s.points.len() <= 50 {
            chart.draw_series(s.points.iter().map(|&q| Circle::new(q, 3, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

fn draw_bars(area: &Area<'_>, b: &Bars) -> DrawResult {
    let n = b.categories.len().max(1);
    let y1 = b
        .series
        .iter()
        .flat_map(|(_, v)| v.iter())
        .fold(0.0f64, |a, &v| a.max(v));
    let y1 = if y1 > 0.0 { y1 * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(&b.title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, 0.0..y1)?;
    let cats = b.categories.clone();
    let fmt_x = move |x: &f64| {
        let i = (x - 0.5).round();
        if (x - 0.5 - i).abs() < 1e-6 && i >= 0.0 {
            cats.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(2 * n + 1)
        .x_label_formatter(&fmt_x)
        .x_label_style(("sans-serif", 11).into_font())
        .y_desc(b.y_label.as_str())
        .y_label_formatter(&|y| format_si(*y))
        .draw()?;
    let k = b.series.len().max(1) as f64;
    let w = 0.8 / k;
    for (g, (name, values)) in b.series.iter().enumerate() {
        let color = Palette99::pick(g).to_rgba();
        let x = |i: usize| i as f64 + 0.1 + g as f64 * w;
        chart
            .draw_series(
                values.iter().enumerate().map(|(i, &v)| {
                    Rectangle::new([(x(i), 0.0), (x(i) + w * 0.9, v)], color.filled())
                }),
            )?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

/// `1.2M`, `350k`, `42`.
fn format_si(y: f64) -> String {
    let a = y.abs();
    if a >= 1e9 {
        format!("{:.1}G", y / 1e9)
    } else if a >= 1e6 {
        format!("{:.1}M", y / 1e6)
    } else if a >= 1e3 {
        format!("{:.0}k", y / 1e3)
    } else if a >= 10.0 || y == y.round() {
        format!("{y:.0}")
    } else {
        format!("{y:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_two_panels_with_legends() {
        let dir = std::env::temp_dir().join(format!("zero-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.svg");
        let s = |name: &str, k: f64| Series {
            name: name.into(),
            points: (1..=4).map(|i| (i as f64 * 100.0, k * i as f64)).collect(),
        };
        let panel = |t: &str| Panel {
            title: t.into(),
            x_label: "Gbps".into(),
            y_label: "tokens/s".into(),
            x_names: None,
            series: vec![s("ZeRO-3", 1000.0), s("ZeRO++", 2500.0)],
        };
        line_charts_svg(&path, &[panel("a"), panel("b")], 800, 300).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        assert!(svg.contains("ZeRO++") && svg.contains("tokens/s"));
        assert_eq!(svg.matches("<circle").count(), 16);
        assert_eq!(format_si(2.5e6), "2.5M");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
