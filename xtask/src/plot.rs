//! Charts as SVG or PNG with plotters: line panels side by side, one line (with markers) per series
//! (`simulate`'s sweeps), and `train`'s report figure (the loss per step beside grouped bars of
//! measured against planned memory).

use std::path::Path;

use anyhow::anyhow;
use plotters::coord::Shift;
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

#[cfg(feature = "engine")]
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

/// Draws `panels` side by side into `path` (SVG, or PNG for `.png`) of `width × height` pixels.
pub(crate) fn line_charts(
    path: &Path,
    panels: &[Panel],
    width: u32,
    height: u32,
) -> anyhow::Result<()> {
    render(path, (width, height), &LineCharts(panels))
}

#[cfg(feature = "engine")]
/// Draws the `lines` panels left to right, then `bars`, side by side into `path` (SVG, or PNG for
/// `.png`) of `width × height`.
pub(crate) fn lines_and_bars(
    path: &Path,
    lines: &[Panel],
    bars: &Bars,
    width: u32,
    height: u32,
) -> anyhow::Result<()> {
    render(path, (width, height), &LinesAndBars(lines, bars))
}

/// Whether a figure goes to a PNG (the path ends in `.png`) rather than an SVG.
fn is_png(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("png"))
}

/// The font every figure's text is drawn with, shipped with xtask (`assets/`: DejaVu Sans cut to
/// Latin-1 and a few signs), registered with plotters once per process. SVG needs it too: text
/// is laid out with its metrics.
fn register_font() -> anyhow::Result<()> {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *FONT.get_or_init(|| {
        let bytes = include_bytes!("../assets/DejaVuSans-subset.ttf");
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    });
    anyhow::ensure!(
        ok,
        "the shipped font assets/DejaVuSans-subset.ttf does not parse"
    );
    Ok(())
}

/// A figure any plotters backend can draw.
trait Figure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB>;
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

struct LineCharts<'a>(&'a [Panel]);

impl Figure for LineCharts<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let areas = root.split_evenly((1, self.0.len().max(1)));
        for (area, p) in areas.iter().zip(self.0) {
            draw_lines(area, p, SeriesLabelPosition::LowerRight)?;
        }
        Ok(())
    }
}

#[cfg(feature = "engine")]
struct LinesAndBars<'a>(&'a [Panel], &'a Bars);

#[cfg(feature = "engine")]
impl Figure for LinesAndBars<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let areas = root.split_evenly((1, self.0.len() + 1));
        for (area, p) in areas.iter().zip(self.0) {
            draw_lines(area, p, SeriesLabelPosition::UpperRight)?;
        }
        match areas.last() {
            Some(area) => draw_bars(area, self.1),
            None => Ok(()),
        }
    }
}

/// Draws `figure` on a white `width × height` canvas into `path`: SVG, or PNG (8-bit RGB, drawn
/// into a buffer, then encoded) when `path` ends in `.png`.
fn render(path: &Path, (width, height): (u32, u32), figure: &impl Figure) -> anyhow::Result<()> {
    fn paint<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, f: &impl Figure) -> DrawResult<DB> {
        root.fill(&WHITE)?;
        f.draw(&root)?;
        root.present()
    }
    register_font()?;
    let err = |e: &dyn std::fmt::Display| anyhow!("cannot draw {}: {e}", path.display());
    if !is_png(path) {
        let root = SVGBackend::new(path, (width, height)).into_drawing_area();
        return paint(root, figure).map_err(|e| err(&e));
    }
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    paint(
        BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area(),
        figure,
    )
    .map_err(|e| err(&e))?;
    let file = std::fs::File::create(path).map_err(|e| err(&e))?;
    let mut png = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    png.set_color(png::ColorType::Rgb);
    png.set_depth(png::BitDepth::Eight);
    let mut w = png.write_header().map_err(|e| err(&e))?;
    w.write_image_data(&rgb).map_err(|e| err(&e))?;
    w.finish().map_err(|e| err(&e))
}

fn draw_lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    p: &Panel,
    legend: SeriesLabelPosition,
) -> DrawResult<DB> {
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

#[cfg(feature = "engine")]
fn draw_bars<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, b: &Bars) -> DrawResult<DB> {
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
pub(crate) mod tests {
    use super::*;

    #[test]
    fn draws_two_panels_with_legends() {
        let tmp = crate::temp_dir("zero-plot-");
        let dir = tmp.path().to_path_buf();
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
        line_charts(&path, &[panel("a"), panel("b")], 800, 300).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        assert!(svg.contains("ZeRO++") && svg.contains("tokens/s"));
        assert_eq!(svg.matches("<circle").count(), 16);
        assert_eq!(format_si(2.5e6), "2.5M");
    }

    /// Decodes a PNG: `(width, height, RGB bytes)`.
    pub(crate) fn decode_png(path: &Path) -> (u32, u32, Vec<u8>) {
        let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
        let mut reader = png::Decoder::new(file).read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    /// A `.png` path gets a PNG that decodes to the asked size, with the lines in their colours
    /// and the text drawn: a longer caption darkens more of the caption's strip.
    #[test]
    fn draws_a_png_with_its_text() {
        let tmp = crate::temp_dir("zero-plot-png-");
        let dir = tmp.path().to_path_buf();
        let panel = |t: &str| Panel {
            title: t.into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            x_names: None,
            series: vec![Series {
                name: "loss".into(),
                points: (0..10)
                    .map(|i| (f64::from(i), 10.0 - f64::from(i)))
                    .collect(),
            }],
        };
        let line = Palette99::pick(0).to_rgba().rgb();
        let dark_in_caption = |title: &str| {
            let path = dir.join(format!("{}.png", title.len()));
            line_charts(&path, &[panel(title)], 400, 300).unwrap();
            let (w, h, rgb) = decode_png(&path);
            assert_eq!((w, h), (400, 300));
            let px = |x: usize, y: usize| &rgb[(y * w as usize + x) * 3..][..3];
            let coloured = (0..h as usize)
                .flat_map(|y| (0..w as usize).map(move |x| (x, y)))
                .filter(|&(x, y)| px(x, y) == [line.0, line.1, line.2])
                .count();
            assert!(coloured > 200, "{coloured} pixels in the line's colour");
            // The caption's strip: the top 30 rows.
            (0..30)
                .flat_map(|y| (0..w as usize).map(move |x| (x, y)))
                .filter(|&(x, y)| px(x, y).iter().all(|&c| c < 128))
                .count()
        };
        let (short, long) = (
            dark_in_caption("a"),
            dark_in_caption("a much longer caption"),
        );
        assert!(short > 0, "no caption drawn");
        assert!(
            long > 3 * short,
            "caption pixels: {short} for 1 letter, {long} for 21"
        );
    }
}
