//! The peers benchmark's charts, as SVG (plotters; no fonts needed).

use anyhow::anyhow;
use plotters::prelude::*;

const SIZE: (u32, u32) = (900, 480);
const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
];

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

/// The legend box every chart here draws, in the corner its data leaves free.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()
        .map_err(err)
}

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// One bar: (workload, system, value, min, max).
pub type Bar<'a> = (&'a str, &'a str, f64, f64, f64);

/// Grouped bars, each with its value written above it and its runs' range as a whisker: net
/// CPU seconds per million packets dropped, per workload and system (only where it dropped).
pub fn cpu_per_dropped(path: &str, bars: &[Bar], cpus: usize) -> anyhow::Result<()> {
    let workloads: Vec<&str> = dedup(bars.iter().map(|b| b.0));
    let systems: Vec<&str> = dedup(bars.iter().map(|b| b.1));
    // Headroom for the legend above the tallest bar.
    let top = bars.iter().map(|b| b.4.max(b.2)).fold(0.0f64, f64::max) * 1.6 + 1e-9;
    let bottom = bars.iter().map(|b| b.3.min(b.2)).fold(0.0f64, f64::min) * 1.25;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let groups = workloads.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Net CPU s per million packets DROPPED (minus a bare XDP_DROP; kernel CPU time of all {cpus} CPUs)"
            ),
            ("sans-serif", 17),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..groups, bottom..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(workloads.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 {
                workloads.get(i).map_or(String::new(), |w| (*w).to_string())
            } else {
                String::new()
            }
        })
        .y_desc("CPU s / M dropped (median, whisker: min-max)")
        .draw()
        .map_err(err)?;
    let width = 0.8 / systems.len() as f64;
    let x_of = |b: &Bar, si: usize| {
        let g = workloads.iter().position(|w| *w == b.0).unwrap_or(0) as f64;
        g + 0.1 + width * si as f64
    };
    for (si, system) in systems.iter().enumerate() {
        let c = color(si);
        let mine = || bars.iter().filter(move |b| b.1 == *system);
        chart
            .draw_series(mine().map(|b| {
                let x0 = x_of(b, si);
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, b.2)], c.filled())
            }))
            .map_err(err)?
            .label(*system)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
        chart
            .draw_series(mine().map(|b| {
                let x = x_of(b, si) + width * 0.45;
                PathElement::new(vec![(x, b.3), (x, b.4)], BLACK.stroke_width(1))
            }))
            .map_err(err)?;
        chart
            .draw_series(mine().map(|b| {
                Text::new(format!("{:.3}", b.2), (x_of(b, si), b.4.max(b.2) + top * 0.01), ("sans-serif", 12))
            }))
            .map_err(err)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present().map_err(err)
}

/// Cumulative packets let through over time for the boundary-burst pattern, with the bound: one
/// panel per system (small multiples), so no line hides another. `bound`: (seconds after the
/// first packet let through, packets), drawn from each system's first packet.
pub fn boundary_burst(path: &str, series: &[(&str, Vec<f64>)], bound: &[(f64, f64)]) -> anyhow::Result<()> {
    let all: Vec<f64> = series.iter().flat_map(|(_, a)| a.iter().copied()).collect();
    let t0 = all.iter().copied().fold(f64::INFINITY, f64::min).min(0.985);
    let t1 = all.iter().copied().fold(0.0f64, f64::max).max(1.02) + 0.005;
    let panels = series.len().max(1);
    let root = SVGBackend::new(path, (SIZE.0, 60 + 190 * panels as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(
            "Two bursts across a second boundary: packets let through (solid) vs the GCRA bound (dashed)",
            ("sans-serif", 17),
        )
        .map_err(err)?;
    for (i, ((name, arrivals), area)) in series.iter().zip(root.split_evenly((panels, 1))).enumerate() {
        let c = color(i);
        // The bound from this system's first packet let through.
        let start = arrivals.first().copied().unwrap_or(t0);
        // Each panel's own height: a few packets let through are not flattened by many.
        let bound_top = bound.iter().filter(|(t, _)| start + t <= t1).map(|b| b.1).fold(0.0f64, f64::max);
        let top = (arrivals.len() as f64).max(bound_top) * 1.25 + 1.0;
        let mut chart = ChartBuilder::on(&area)
            .margin(8)
            .margin_right(20)
            .x_label_area_size(if i + 1 == panels { 35 } else { 20 })
            .y_label_area_size(50)
            .build_cartesian_2d(t0..t1, 0.0..top)
            .map_err(err)?;
        let mut mesh = chart.configure_mesh();
        mesh.y_desc("let through").y_labels(4);
        if i + 1 == panels {
            mesh.x_desc("seconds since the sender's clock started (bursts at 0.990 and 1.000)");
        }
        mesh.draw().map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new(
                bound.iter().map(|(t, n)| (start + t, *n)).filter(|(t, _)| *t <= t1),
                6,
                4,
                BLACK.stroke_width(2),
            ))
            .map_err(err)?
            .label("GCRA bound from the first packet")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLACK.stroke_width(2)));
        let mut steps = vec![(t0, 0.0)];
        for (n, t) in arrivals.iter().enumerate() {
            steps.push((*t, n as f64));
            steps.push((*t, n as f64 + 1.0));
        }
        steps.push((t1, arrivals.len() as f64));
        chart
            .draw_series(LineSeries::new(steps, c.stroke_width(2)))
            .map_err(err)?
            .label(format!("{name} ({} let through)", arrivals.len()))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2)));
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    }
    root.present().map_err(err)
}

/// One point of the memory chart: distinct sources, MiB as measured (may be below 0: within
/// noise), and whether the system's table was full (it had stopped tracking new keys).
#[derive(Clone, Copy, Debug)]
pub struct MemoryPoint {
    pub sources: f64,
    pub mib: f64,
    pub full: bool,
}

/// State memory against distinct sources (log x), values as measured (the axis goes through 0;
/// negative ones are within the measurement's noise). Points where a system's table was full
/// are hollow and labelled: its memory stopped growing because it stopped tracking keys.
pub fn memory(path: &str, series: &[(&str, Vec<MemoryPoint>)], cpus: usize) -> anyhow::Result<()> {
    let points = || series.iter().flat_map(|(_, p)| p.iter());
    let x0 = points().map(|p| p.sources).fold(f64::INFINITY, f64::min).max(1.0);
    let x1 = points().map(|p| p.sources).fold(0.0f64, f64::max).max(x0 * 10.0) * 1.5;
    let top = points().map(|p| p.mib).fold(1.0f64, f64::max) * 1.2;
    let bottom = points().map(|p| p.mib).fold(0.0f64, f64::min) * 1.2 - top * 0.05;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Kernel memory the limiting state took, by distinct sources ({cpus} CPUs)"),
            ("sans-serif", 17),
        )
        .margin(15)
        .margin_right(45)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0 * 0.7..x1).log_scale(), bottom..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("distinct sources (IPv6 /64)")
        .y_desc("MiB (below 0: within noise)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    chart.draw_series(LineSeries::new([(x0 * 0.7, 0.0), (x1, 0.0)], BLACK.stroke_width(1))).map_err(err)?;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points.iter().map(|p| (p.sources, p.mib)), c.stroke_width(2)))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|p| {
                let style = if p.full { c.stroke_width(2) } else { c.filled() };
                Circle::new((p.sources, p.mib), 5, style)
            }))
            .map_err(err)?;
        chart
            .draw_series(points.iter().filter(|p| p.full).map(|p| {
                // Left of the point (log x: a factor), so the last one stays inside the chart.
                Text::new(
                    format!("{} full", short_name(name)),
                    (p.sources / 3.2, p.mib),
                    ("sans-serif", 12).into_font().color(&c),
                )
            }))
            .map_err(err)?;
    }
    chart
        .draw_series([Text::new(
            "hollow: table full, new keys no longer tracked",
            (x0 * 0.75, bottom + (top - bottom) * 0.04),
            ("sans-serif", 13),
        )])
        .map_err(err)?;
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(err)
}

/// The first word of a series name, for a label next to its points.
fn short_name(name: &str) -> &str {
    name.split([' ', ',']).next().unwrap_or(name)
}

/// One row count's points: (flooders, measured %, theory %).
pub type LossSeries = (String, Vec<(f64, f64, f64)>);

/// Innocent loss (%) against flooders: per series (one per row count), theory as a line and the
/// measurements as points, in the same colour.
pub fn innocent_loss(path: &str, caption: &str, series: &[LossSeries]) -> anyhow::Result<()> {
    let x1 = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.0)).fold(1.0f64, f64::max) * 1.05;
    let top = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.1.max(p.2))).fold(1.0f64, f64::max) * 1.1;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(15)
        .margin_right(45)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x1, 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("flooding sources")
        .y_desc("innocent sources refused (%)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points.iter().map(|p| (p.0, p.2)), c.stroke_width(2)))
            .map_err(err)?
            .label(format!("{name}: theory (line), measured (dots)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2)));
        chart.draw_series(points.iter().map(|p| Circle::new((p.0, p.1), 4, c.filled()))).map_err(err)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(err)
}

fn dedup<'a>(it: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<&str> = Vec::new();
    for x in it {
        if !v.contains(&x) {
            v.push(x);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each chart renders to a file naming every series it was given (the bench only runs by hand).
    #[test]
    fn charts_render_with_their_series() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("limiter-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
        let read = |p: &str| std::fs::read_to_string(p);

        let cpu = path("cpu.svg");
        cpu_per_dropped(
            &cpu,
            &[("one source", "limiter", 0.07, 0.06, 0.08), ("one source", "hashlimit", 0.69, 0.6, 0.7)],
            2,
        )?;
        let svg = read(&cpu)?;
        assert!(svg.contains("limiter") && svg.contains("hashlimit") && svg.contains("one source"));
        assert!(svg.contains("DROPPED") && svg.contains("2 CPUs") && svg.contains("0.690"));

        let burst = path("burst.svg");
        boundary_burst(
            &burst,
            &[("limiter", vec![0.99, 0.991, 1.0]), ("nft", vec![0.99, 0.991])],
            &[(0.0, 1.0), (0.02, 3.0)],
        )?;
        let svg = read(&burst)?;
        assert!(svg.contains("limiter (3 let through)") && svg.contains("nft (2 let through)"));

        let mem = path("memory.svg");
        let p = |sources, mib, full| MemoryPoint { sources, mib, full };
        memory(&mem, &[("nftables meter", vec![p(1e3, -0.5, false), p(1e6, 40.0, true)])], 2)?;
        let svg = read(&mem)?;
        assert!(svg.contains("nftables meter") && svg.contains("nftables full") && svg.contains("(2 CPUs)"));

        let loss = path("loss.svg");
        innocent_loss(&loss, "innocent loss", &[("D = 4".into(), vec![(5e3, 0.3, 0.48), (2e4, 25.1, 24.7)])])?;
        assert!(read(&loss)?.contains("D = 4: theory"));

        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
